"""DeepSeek-V4's decode-step compressors and indexer scores, one launch each: a decode
step's many small torch ops (state row writes, slot gathers, softmax pooling, RMSNorm,
rope, where-writes; a float32 copy of every key of the block table) become two kernels.

Layouts and arithmetic: kernels/reference/v4_compress.py (the torch twin) documents them;
the @triton.jit bodies are in _v4_compress_kernels.py. Neither launch reads anything back
to the host: the grids come from static shapes (B, the block tables' width), what a row
does from its position on the device, so a CUDA graph captures both.

`v4_compress_decode`: one program per row. It writes the token's (kv, score + ape[p % m])
into state row p % reach (bit for bit the twin's float32 values); a row whose token closes
its window (p % m == m - 1) then reads the window's S slots (m; 2m with CSA's overlap,
window -1's Ca slots kv 0 and score -inf), its own token from the step's inputs rather
than from the row just stored (no ordering between a program's threads is needed), pools
per channel in float32 (max over the slots, then sum e^(s - max) and sum kv e^(s - max) in
tiles of BLOCK_S slots), RMSNorms, ropes at w * m and stores the entry at its paged row;
the other rows store nothing. One program per row, not per channel tile: the norm needs
all d channels. Floor per row and layer: the token's 2 * W projection values, and at a
window close the state rows reach * W * 4 * 2 bytes at most (S * d * 4 * 2 are read: HCA
at V4-Flash 128 * 512 * 8 = 512 KiB once every 128 steps, CSA 8 * 512 * 8 = 32 KiB every 4)
plus d entry values written.

`v4_indexer_scores`: one program per (row, BLOCK_N entries); it holds the row's q [Hi, d_i]
and weights and multiplies each key tile [BLOCK_N, d_i] once for all heads (tl.dot, heads
padded to 16), so each committed key is read once: n * d_i * 2 bytes per row and layer in
bf16 (V4-Flash at 64k context: 16384 * 128 * 2 = 4 MiB), the floor. Tiles past a row's
committed entries write -inf and read nothing. The caller takes the top-k (torch.topk)
and maps -inf picks to -1.

The entries differ from the twin's by float rounding (the exp, the sum orders, fused
multiply-adds), not bit for bit; the states written are equal bit for bit.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._common import check_device, interpreting, next_pow2
from kernels.triton._v4_compress_kernels import (
    v4_compress_decode_kernel,
    v4_indexer_scores_kernel,
)

# values of one pooling tile [BLOCK_S, d / 2] (kv and score, one parity): 8 slots at d = 512
POOL_TILE = 2048


def v4_compress_decode(
    kv: torch.Tensor,
    score: torch.Tensor,
    ape: torch.Tensor,
    state: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    state_slots: torch.Tensor,
    block_tables: torch.Tensor,
    norm_weight: torch.Tensor,
    inv_freq: torch.Tensor,
    eps: float,
    overlap: bool,
    num_warps: int = 4,
) -> None:
    """One decode token per row through a compressor, in place: kv, score [B, W] (the
    compressor's projections) at positions [B] into the pooling states [slots, 2, reach, W]
    float32 at state_slots [B]; each token closing a window writes that window's entry
    into cache [num_blocks, block_size // m, d] through block_tables [B, max_blocks] int32."""
    bsz, width = kv.shape
    ratio = ape.shape[0]
    d = width // 2 if overlap else width
    assert score.shape == kv.shape, f"score {list(score.shape)} != kv {list(kv.shape)}"
    assert kv.stride(-1) == 1 and score.stride(-1) == 1, "kv and score: contiguous rows"
    assert d == next_pow2(d) and d >= 2, f"entry width {d} must be a power of 2"
    assert ratio == next_pow2(ratio), f"compress ratio {ratio} must be a power of 2"
    assert ape.shape == (ratio, width) and ape.dtype == torch.float32 and ape.is_contiguous(), (
        f"ape must be [{ratio}, {width}] float32, contiguous"
    )
    slots_needed = 2 * ratio if overlap else ratio
    assert state.dim() == 4 and state.shape[1] == 2 and state.shape[3] == width, (
        f"state must be [slots, 2, reach, {width}], got {list(state.shape)}"
    )
    assert state.dtype == torch.float32 and state.stride(-1) == 1, "state: float32 rows"
    assert state.shape[2] >= slots_needed, f"state reach {state.shape[2]} < {slots_needed}"
    assert cache.dim() == 3 and cache.shape[2] == d and cache.stride(-1) == 1, (
        f"cache must be [num_blocks, block_size // {ratio}, {d}], got {list(cache.shape)}"
    )
    assert positions.shape == (bsz,) and state_slots.shape == (bsz,), f"need [{bsz}] indices"
    assert block_tables.dim() == 2 and block_tables.shape[0] == bsz, "block_tables [B, blocks]"
    assert block_tables.dtype == torch.int32, "block_tables must be int32"
    assert norm_weight.shape == (d,) and norm_weight.dtype == torch.float32, "norm [d] float32"
    half = inv_freq.shape[0]
    assert inv_freq.dtype == torch.float32 and 2 * half <= d, "inv_freq [P/2] float32, P <= d"
    check_device(kv, score, ape, state, cache, positions, state_slots, block_tables,
                 norm_weight, inv_freq)  # fmt: skip
    if bsz == 0:
        return
    block_s = min(slots_needed, max(1, POOL_TILE // (d // 2)))  # powers of 2, so a divisor
    v4_compress_decode_kernel[(bsz,)](
        kv, score, ape, state, cache, positions, state_slots, block_tables,
        norm_weight, inv_freq.contiguous(),
        state.shape[2], eps,
        kv.stride(0), score.stride(0), state.stride(0), state.stride(1), state.stride(2),
        cache.stride(0), cache.stride(1), block_tables.stride(0),
        D=d, W=width, RATIO=ratio, OVERLAP=overlap, BS=cache.shape[1] * ratio,
        ROPE_HALF=half, BLOCK_S=block_s, ACCURATE_TRIG=not interpreting(),
        num_warps=num_warps,
    )  # fmt: skip


def v4_indexer_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    ratio: int,
    block_n: int = 64,
    num_warps: int = 4,
) -> torch.Tensor:
    """q [B, Hi, d_i] (roped), weights [B, Hi] (weights_proj(x)), the paged indexer keys
    [num_blocks, block_size // m, d_i] through block_tables [B, max_blocks] int32, positions
    [B] -> scores [B, n] float32, n = max_blocks * block_size // m (a shape, so the step's
    data never sizes it): sum_h w_h Hi^-0.5 ReLU(q_h . k_s) d_i^-0.5 for s < (pos + 1) // m,
    -inf past it."""
    assert q.dim() == 3 and q.stride(-1) == 1, f"q must be [B, Hi, d_i], got {list(q.shape)}"
    bsz, heads, dim = q.shape
    assert dim == next_pow2(dim) and dim >= 16, f"d_i {dim}: a power of 2 >= 16 (tl.dot)"
    assert weights.shape == (bsz, heads) and weights.stride(-1) == 1, f"weights [{bsz}, {heads}]"
    assert keys.dim() == 3 and keys.shape[2] == dim and keys.stride(-1) == 1, (
        f"keys must be [num_blocks, block_size // {ratio}, {dim}], got {list(keys.shape)}"
    )
    assert positions.shape == (bsz,), f"positions must be [{bsz}]"
    assert block_tables.dim() == 2 and block_tables.shape[0] == bsz, "block_tables [B, blocks]"
    assert block_tables.dtype == torch.int32, "block_tables must be int32"
    assert block_n >= 16 and block_n == next_pow2(block_n), f"block_n {block_n}: pow2 >= 16"
    check_device(q, weights, keys, positions, block_tables)
    n = block_tables.shape[1] * keys.shape[1]
    scores = torch.empty((bsz, n), dtype=torch.float32, device=q.device)
    if bsz == 0 or n == 0:
        return scores
    v4_indexer_scores_kernel[(bsz, triton.cdiv(n, block_n))](
        q, weights, keys, positions, block_tables, scores,
        heads, n, heads**-0.5 * dim**-0.5,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), keys.stride(1),
        block_tables.stride(0), scores.stride(0),
        D=dim, RATIO=ratio, BS=keys.shape[1] * ratio, BLOCK_H=max(16, next_pow2(heads)),
        BLOCK_N=block_n, IEEE=interpreting() or q.dtype == torch.float32,
        num_warps=num_warps,
    )  # fmt: skip
    return scores
