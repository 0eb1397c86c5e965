"""DeepSeek-V4 decode attention over the engine's decode state: one query per sequence
sees its window (a ring per state slot) and its compressed entries (paged): none for a
sliding layer, every committed one for HCA, the indexer's selection for CSA; softmax with
a per-head sink logit that takes probability and gives no value; scale head_dim^-0.5.

Layouts and visibility: kernels/reference/v4_attention.py (the torch twin) documents
them; the @triton.jit bodies are in _v4_attention_kernels.py. q is normed and roped; the
output is in q's dtype and not de-rotated (the caller does it). Scores, softmax and
accumulators are float32; with bf16 inputs on a GPU the probabilities are rounded to bf16
for the value product (tensor cores), so the result differs from the float32 twin by
about bf16's precision.

Flash-decoding. A row's visible keys (window first, then entries) are cut into splits of
SPLIT_TILES tiles of BLOCK_N keys, at most MAX_SPLITS (longer splits past that); the
split count is a function of the row's own key count, never of the batch or of the
grid. A row of one split finishes in the split kernel (sink included); a row of several
writes each split's unnormalised (acc, max, sum) and the combine kernel merges them with
the sink (which adds e^(sink - max) to the denominator and nothing to the numerator).
The grid's split axis comes from host-known maxima (the window, index_topk, the HCA
layer's longest position), never from the device, so a launch has no host sync and
captures into a CUDA graph; programs past a row's own split count exit at once.

Heads per program. MQA: every head reads the same keys, so a program holds BLOCK_H = 16
heads' q [16, head_dim] and multiplies each key tile [BLOCK_N, head_dim] once for all of
them (s = q k^T, then acc += p k: K is V, one load serves both). All 64 heads of V4-Flash
in one program would need a [64, 512] float32 accumulator, 128 KiB, half an SM's register
file for one program (it would spill); cutting acc along head_dim does not work either,
because the scores need the whole head_dim before the softmax. 16 heads (tl.dot's
smallest M) keep acc at 32 KiB, beside a 32 KiB bf16 key tile, as in mla_decode. The 4
head groups of a row are neighbours on the grid's second axis and run together, so each
key tile comes from DRAM once and three times from L2: the DRAM floor per row and layer
stays bytes = (window + selected) * head_dim * 2 (V4-Flash CSA: (128 + 512) * 1024 =
640 KiB; HCA at context L: (128 + L / 128) * 1024).

The defaults (BLOCK_N 32, 8 tiles per split, at most 16 splits, 8 warps, 1 stage)
follow mla_decode's shapes at the same head_dim and have not been timed on this kernel.
Compiled offline for sm_90a at head_dim 512, bf16: 128 / 202 / 201 registers (sliding /
HCA / CSA) and no spills; with 2 stages CSA's pipelined selection loads spill (255
registers, 60 B), so one stage. The partials take B * H * splits * head_dim * 4 bytes
(CSA at batch 256: 100 MiB).
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._common import check_device, interpreting, next_pow2
from kernels.triton._v4_attention_kernels import (
    v4_attention_combine_kernel,
    v4_attention_split_kernel,
)

MODES = {"sliding": 0, "hca": 1, "csa": 2}
BLOCK_H = 16  # tl.dot's smallest M; heads past H are masked


def num_splits_for(max_keys: int, block_n: int, split_tiles: int, max_splits: int) -> int:
    """The grid's split axis: no row with at most `max_keys` keys uses more
    (_split_rule's count grows with the keys until it is capped)."""
    return max(1, min(max_splits, triton.cdiv(triton.cdiv(max_keys, block_n), split_tiles)))


def max_visible_keys(
    mode: str, window: int, ratio: int, index_topk: int = 0, max_position: int | None = None
) -> int:
    """The most keys a query of the layer sees: its window plus its entry columns."""
    if mode == "sliding":
        return window
    if mode == "csa":
        return window + index_topk
    assert max_position is not None, "hca needs max_position, the longest position of a row"
    return window + (max_position + 1) // ratio


def v4_attention_decode(
    q: torch.Tensor,
    ring: torch.Tensor,
    cache: torch.Tensor | None,
    positions: torch.Tensor,
    state_slots: torch.Tensor,
    block_tables: torch.Tensor | None,
    sinks: torch.Tensor,
    *,
    window: int,
    ratio: int,
    mode: str,
    sel: torch.Tensor | None = None,
    max_position: int | None = None,
    block_n: int = 32,
    split_tiles: int = 8,
    max_splits: int = 16,
    num_warps: int = 8,
    num_stages: int = 1,
) -> torch.Tensor:
    """-> o [B, H, head_dim] in q's dtype. `max_position` (HCA only) bounds every row's
    position: a row past it would lose its last splits, so pass the longest position a
    sequence can reach (e.g. the model's length - 1), the same for every step of a graph.
    `block_n`, `split_tiles`, `max_splits` set the split rule; they change a row's
    rounding, so keep them fixed per layer kind."""
    assert mode in MODES, f"mode must be one of {list(MODES)}, got {mode!r}"
    assert q.dim() == 3 and q.stride(-1) == 1, f"q must be [B, H, head_dim], got {list(q.shape)}"
    bsz, heads, head_dim = q.shape
    assert head_dim == next_pow2(head_dim), f"head_dim {head_dim} must be a power of 2"
    assert ring.dim() == 3 and ring.shape[2] == head_dim and ring.stride(-1) == 1, (
        f"ring must be [slots, ring_size, {head_dim}], got {list(ring.shape)}"
    )
    assert ring.shape[1] >= window >= 1, f"ring_size {ring.shape[1]} < window {window}"
    assert positions.shape == (bsz,) and state_slots.shape == (bsz,), (
        f"positions and state_slots must be [{bsz}]"
    )
    assert sinks.shape == (heads,) and sinks.dtype == torch.float32, "sinks must be [H] float32"
    assert block_n >= 16 and block_n == next_pow2(block_n), f"block_n {block_n}: pow2 >= 16"
    index_topk = 0
    if mode == "sliding":
        cache = block_tables = ring  # never read
        block_size, ratio = 1, 1
    else:
        assert cache is not None and block_tables is not None, f"{mode} needs the paged cache"
        assert cache.dim() == 3 and cache.shape[2] == head_dim and cache.stride(-1) == 1, (
            f"cache must be [num_blocks, block_size // ratio, {head_dim}], got {list(cache.shape)}"
        )
        assert cache.dtype == ring.dtype, f"cache {cache.dtype} and ring {ring.dtype} differ"
        block_size = cache.shape[1] * ratio
        assert block_tables.dim() == 2 and block_tables.shape[0] == bsz, (
            f"block_tables must be [{bsz}, max_blocks], got {list(block_tables.shape)}"
        )
        assert block_tables.dtype == torch.int32, "block_tables must be int32"
    if mode == "csa":
        assert sel is not None and sel.dim() == 2 and sel.shape[0] == bsz, (
            f"csa needs sel [{bsz}, index_topk]"
        )
        assert sel.dtype == torch.int32 and sel.stride(-1) == 1, "sel must be int32, contiguous"
        index_topk = sel.shape[1]
    else:
        sel = positions  # never read
    check_device(q, ring, cache, positions, state_slots, block_tables, sinks, sel)
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    max_keys = max_visible_keys(mode, window, ratio, index_topk, max_position)
    num_splits = num_splits_for(max_keys, block_n, split_tiles, max_splits)
    if num_splits > 1:
        acc = torch.empty((bsz, heads, num_splits, head_dim), dtype=torch.float32,
                          device=q.device)  # fmt: skip
        maxes = torch.empty((bsz, heads, num_splits), dtype=torch.float32, device=q.device)
        sums = torch.empty_like(maxes)
    else:  # never written: every row finishes in the split kernel
        acc = maxes = sums = out
    meta = dict(RATIO=ratio, MODE=MODES[mode], BLOCK_N=block_n, SPLIT_TILES=split_tiles,
                MAX_SPLITS=max_splits)  # fmt: skip
    v4_attention_split_kernel[(bsz, triton.cdiv(heads, BLOCK_H), num_splits)](
        q, ring, cache, positions, state_slots, block_tables, sel, sinks, out, acc, maxes, sums,
        heads, window, ring.shape[1], index_topk, head_dim**-0.5,
        q.stride(0), q.stride(1), ring.stride(0), ring.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0), sel.stride(0),
        out.stride(0), out.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2) if num_splits > 1 else 0,
        maxes.stride(0), maxes.stride(1),
        HEAD_DIM=head_dim, BS=block_size, BLOCK_H=BLOCK_H,
        IEEE=interpreting() or q.dtype == torch.float32, **meta,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        v4_attention_combine_kernel[(bsz, heads)](
            positions, sinks, out, acc, maxes, sums, window, index_topk,
            out.stride(0), out.stride(1), acc.stride(0), acc.stride(1), acc.stride(2),
            maxes.stride(0), maxes.stride(1),
            HEAD_DIM=head_dim, **meta,
        )  # fmt: skip
    return out
