"""MLA decode attention in the absorbed form over a paged compressed cache.

Legend: docs/shapes.md (B sequences, one new token each; H heads; R kv_lora_rank, 512 in
DeepSeek-V3; P qk_rope, 64). The kernel's meta-parameters name R `KVL` and P `R`.
  cache [num_blocks, block_size, R + P]: per token the normalised latent c and the roped k_rot
  q_c [B, H, R] (q_nope absorbed through kv_b's key half), q_rope [B, H, P]
  block_tables [B, max_blocks] int32, context_lens [B] (>= 1, includes the new token)
  out [B, H, R] = softmax(scale * (q_c . c_l + q_rope . k_rot_l)) @ c   (per head)
The caller applies kv_b's value half to `out`. Torch twin: kernels/reference/mla_decode.py;
the @triton.jit body is in _mla_decode_kernels.py.

The sequence is split into up to `num_splits` chunks (flash-decoding) so a few long
sequences still fill the GPU. `num_splits` is a launch constant (the grid's third axis):
pass the same value for every step of a CUDA graph bucket; choose_num_splits gives one
from the host-known longest context. Each sequence then uses only as many splits as its
own device-side length calls for (about sqrt(2 * its 32-token tiles)); with one split the
program writes the output directly, otherwise each split writes a normalised partial and
its log-sum-exp and the last split to finish (an arrival counter) merges them: one launch
in every case, so a graph captured for the longest context stays one launch per layer.

At a few sequences `value_blocks` programs share a head block's output columns (the grid's
second axis is head block x value block): each computes the scores over the whole latent
but accumulates, stores and merges only its R / value_blocks columns, so the work a
program does once per launch shrinks while the idle SMs take the extra programs.
"""

from __future__ import annotations

import math

import torch
import triton

from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, interpreting, next_pow2, sm_count
from kernels.triton._mla_decode_kernels import mla_decode_kernel

MAX_SPLITS = 64


def splits_for_context(context: int, block_t: int = 32) -> int:
    """The kernel's own rule (see _mla_decode_kernels): about sqrt(2 * tiles) splits."""
    return max(1, math.isqrt(2 * -(-context // block_t)))


def choose_num_splits(
    batch: int, max_context: int, heads: int, device: torch.device, block_t: int = 32
) -> int:
    """About one program per SM over (sequence, head-block, split), and no more splits than
    the kernel would use for `max_context` (extra ones exit at once). Once sequences x head
    blocks fill the SMs, one split per sequence is fastest (H200, `bench mla-decode`,
    batch 256, context 192: 29 us against 42 with two splits; docs/notes-gpu-kernels.md).
    Rounding accepts some idle SMs (100 programs on 132 SMs get one split each) rather
    than a merge of partials."""
    sms = sm_count(device)
    programs = batch * triton.cdiv(heads, 16)
    want = round(sms / programs)
    return max(1, min(want, splits_for_context(max_context, block_t), MAX_SPLITS))


def default_num_warps(kvl: int, num_splits: int) -> int:
    """8 warps for a wide latent split over the sequence; 4 when each program streams a
    whole sequence (one split: the grid already fills the GPU, and more programs fit per
    SM): H200, Moonlight batch 256, 29 us at 4 warps against 52 at 8."""
    return 8 if kvl >= 256 and num_splits > 1 else 4


def default_value_blocks(batch: int, heads: int, num_splits: int, kvl: int, device) -> int:
    """Output latent blocks per head block: at a few sequences the (sequence, head block,
    split) programs leave most SMs idle and each one's fixed work (the [16, R] output,
    its partial and the merge) is the kernel's time, so up to 4 programs share it, each
    owning R / 4 output columns (the scores, over the whole latent, are computed by
    each). Only while the programs still fit on the SMs at once."""
    sms = sm_count(device)
    programs = batch * triton.cdiv(heads, 16) * num_splits
    blocks = 1
    while blocks < 4 and 2 * blocks * programs <= sms and kvl // (2 * blocks) >= 64:
        blocks *= 2
    return blocks


def mla_decode(
    q_c: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    block_t: int = 32,
    num_warps: int | None = None,
    num_stages: int = 2,
    prefetch: int = 1,
    value_blocks: int | None = None,
    partial_splits: int | None = None,
) -> torch.Tensor:
    """Returns [B, H, R] in q_c's dtype. See the module docstring for the layouts.
    `prefetch` (split sequences only): 1 loads each cache tile's page indices one tile
    ahead (~6% less time per launch at batch 1 on the H200, docs/notes-gpu-engine.md), 0
    does not.
    `value_blocks` (default_value_blocks when None) splits each head block's output
    columns over that many programs.
    `partial_splits` (num_splits when None): the splits' scratch is allocated for that
    many; pass splits_for_context(longest context, block_t) where the host knows it, as
    no sequence uses more. Memory only: the launch, so every row's bits, is the same."""
    assert q_c.dim() == 3 and q_rope.dim() == 3, "q_c and q_rope must be [B, H, D]"
    bsz, heads, kvl = q_c.shape
    r = q_rope.shape[-1]
    assert q_rope.shape[:2] == (bsz, heads), f"q_rope {list(q_rope.shape)} vs q_c {list(q_c.shape)}"
    assert kv_cache.dim() == 3 and kv_cache.shape[-1] == kvl + r, (
        f"kv_cache must be [num_blocks, block_size, {kvl + r}], got {list(kv_cache.shape)}"
    )
    assert kvl == next_pow2(kvl) and r == next_pow2(r), f"kv_lora {kvl} and rope {r}: powers of 2"
    assert block_tables.dim() == 2 and block_tables.shape[0] == bsz, (
        f"block_tables must be [{bsz}, max_blocks], got {list(block_tables.shape)}"
    )
    assert context_lens.shape == (bsz,), f"context_lens must be [{bsz}]"
    assert q_c.stride(-1) == 1 and q_rope.stride(-1) == 1 and kv_cache.stride(-1) == 1
    assert num_splits >= 1, f"num_splits must be >= 1, got {num_splits}"
    assert prefetch in (0, 1), f"prefetch must be 0 or 1, got {prefetch}"
    if value_blocks is None:
        value_blocks = default_value_blocks(bsz, heads, num_splits, kvl, q_c.device)
    assert (
        value_blocks >= 1
        and kvl % value_blocks == 0
        and (kvl // value_blocks == next_pow2(kvl // value_blocks))
    ), f"value_blocks must split kv_lora {kvl} into powers of 2, got {value_blocks}"
    check_device(q_c, q_rope, kv_cache, block_tables, context_lens)
    out = torch.empty((bsz, heads, kvl), dtype=q_c.dtype, device=q_c.device)
    if bsz == 0:
        return out
    block_h = 16  # tl.dot's smallest M; heads beyond H are masked
    head_blocks = triton.cdiv(heads, block_h)
    if num_splits > 1:
        kept = num_splits if partial_splits is None else max(1, min(partial_splits, num_splits))
        o_part = torch.empty((bsz, heads, kept, kvl), dtype=torch.float32, device=q_c.device)
        lse = torch.empty((bsz, heads, kept), dtype=torch.float32, device=q_c.device)
        counters = arrival_counters(q_c.device, bsz * head_blocks * value_blocks)
    else:  # never read: one split writes `out` directly
        o_part = lse = counters = out
    mla_decode_kernel[(bsz, head_blocks * value_blocks, num_splits)](
        q_c, q_rope, kv_cache, block_tables, context_lens, out, o_part, lse, counters,
        heads, float(scale),
        q_c.stride(0), q_c.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2) if num_splits > 1 else 0,
        lse.stride(0), lse.stride(1),
        KVL=kvl, R=r, BS=kv_cache.shape[1], NUM_SPLITS=num_splits,
        BLOCK_S=next_pow2(num_splits), MERGE_UNROLL=min(4, num_splits),
        BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_V=kvl // value_blocks,
        F32_DOT=interpreting(), PREFETCH=prefetch,
        num_warps=num_warps or default_num_warps(kvl, num_splits), num_stages=num_stages,
    )  # fmt: skip
    return out
