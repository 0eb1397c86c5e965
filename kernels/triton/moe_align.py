"""Group (token, expert) pairs by expert for the fused MoE kernels.

Legend: docs/shapes.md (T tokens, K experts per token, E experts). The T*K pairs are
numbered p = t*K + k (token t's k-th choice); BLOCK_M is the MoE kernels' tile height.

The result pads each expert's pairs to a multiple of BLOCK_M so every BLOCK_M tile of
`sorted_pairs` belongs to one expert. Every size is computed from host-known T, K, E,
BLOCK_M (never read back from the device), so the step is CUDA-graph capturable and syncs
nothing. The torch twin, and the statement of the layout, is kernels/reference/
moe_align.py; the kernels give the same bits (ranks within an expert are stable).

Two ways, chosen by the number of pairs (both also zero an optional float32 buffer the down
kernel then accumulates into, the combine, in extra programs, so that costs no launch of
its own; the @triton.jit bodies are in _moe_align_kernels.py):
- one chunk of pairs (batch-1..16 decode): one Triton launch whose program 0 does the whole
  grouping, a few microseconds, where the torch twin's chain is ~20 kernels of ~3 us;
- more (batch 32..~700): two launches over chunks of pairs in parallel. `moe_count_kernel`
  writes each chunk's per-expert counts; in `moe_place_kernel` every chunk's program sums
  the counts of all chunks (the padded expert starts) and of the chunks before its own (its
  offset), and scatters its pairs, while extra programs write the tile -> expert map and
  the pad slots (one program alone loops over batch 128's 768 pairs in ~51 us per MoE
  layer on the H200, ~12% of the step).
- above PREFIX_MIN_PAIRS (prefill): the same two launches with a cumsum of the chunk counts
  between them, so each program reads two rows of it (its offset, the totals) instead of
  summing every chunk's counts, which grows with the square of the chunks (the torch
  twin's ~20 launches per MoE layer would leave a prefill step host-bound).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.triton._common import check_device, next_pow2
from kernels.triton._moe_align_kernels import (
    moe_align_kernel,
    moe_count_kernel,
    moe_place_kernel,
)

ZERO_BLOCK = 4096  # float32 elements zeroed per extra program
# From this many pairs the place kernel's programs read a prefix sum of the chunk counts
# (one cumsum launch) instead of each summing the counts of every chunk: at 4096 pairs and
# 64 experts that loop reads 64 rows per program, 64 programs; at a 16K-token prefill's
# 98K pairs it would read 1,536 rows in each of 1,536 programs.
PREFIX_MIN_PAIRS = 4096


@dataclass
class MoeAlignment:
    sorted_pairs: torch.Tensor  # [max_padded] int32: pair ids grouped by expert, pad = T*K
    block_expert: torch.Tensor  # [max_blocks] int32: expert of each tile, -1 = unused
    num_pairs: int  # T*K
    block_m: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """At most min(E, pairs) experts are hit, each padding at most BLOCK_M - 1 slots."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    zero: torch.Tensor | None = None,
) -> MoeAlignment:
    """topk_ids [T, K] (any int dtype, values in [0, E)) -> MoeAlignment, in one launch, or
    two (three from PREFIX_MIN_PAIRS pairs) over chunks of pairs. `zero` (a contiguous
    float32 tensor, e.g. the combine's accumulator) is zeroed by the same launches."""
    assert topk_ids.dim() == 2, f"topk_ids must be [T, K], got {list(topk_ids.shape)}"
    assert zero is None or (zero.dtype == torch.float32 and zero.is_contiguous()), (
        "zero must be a contiguous float32 tensor"
    )
    check_device(topk_ids)
    device = topk_ids.device
    flat = topk_ids.reshape(-1)  # [T*K]
    if not flat.is_contiguous():
        flat = flat.contiguous()
    p = flat.numel()
    max_padded = max_padded_pairs(p, num_experts, block_m)
    max_blocks = -(-max_padded // block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    n_zero = zero.numel() if zero is not None else 0
    zero_programs = triton.cdiv(n_zero, ZERO_BLOCK)
    zero_buf = zero if zero is not None else sorted_pairs  # not written when n_zero is 0
    block_e = next_pow2(num_experts)
    # One-hot chunks of ~8K int32 elements: registers of 4 warps, no spills.
    chunk = max(16, min(256, 8192 // block_e))
    if p <= chunk:
        # A batch-1 step has 6-8 pairs and as many tiles: steps no wider than those keep the
        # one program's one-hot tiles and scans small.
        moe_align_kernel[(1 + zero_programs,)](
            flat, sorted_pairs, block_expert, zero_buf,
            p, num_experts, max_blocks, n_zero,
            BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(16, min(chunk, next_pow2(p))),
            TILES=max(16, min(64, next_pow2(max_blocks))), ZBLOCK=ZERO_BLOCK, num_warps=4,
        )  # fmt: skip
        return MoeAlignment(sorted_pairs, block_expert, p, block_m)
    chunk = max(16, min(128, 4096 // block_e))  # smaller chunks: more programs in parallel
    n_chunks = triton.cdiv(p, chunk)
    # Expert-major, so the prefix sum runs along contiguous memory: torch's scan over the
    # outer dimension of [chunks, experts] is one serial thread per expert (H200: 550 us
    # per layer at a 16K-token prefill, 14.8 ms of its step).
    chunk_counts = torch.empty(block_e, n_chunks, dtype=torch.int32, device=device)
    moe_count_kernel[(n_chunks + zero_programs,)](
        flat, chunk_counts, zero_buf, p, n_chunks, n_zero,
        BLOCK_E=block_e, CHUNK=chunk, ZBLOCK=ZERO_BLOCK, num_warps=4,
    )  # fmt: skip
    prefix = p >= PREFIX_MIN_PAIRS
    if prefix:
        chunk_counts = torch.cumsum(chunk_counts, dim=1, dtype=torch.int32)
    tiles = 32
    moe_place_kernel[(n_chunks + triton.cdiv(max_blocks, tiles),)](
        flat, chunk_counts, sorted_pairs, block_expert,
        p, num_experts, n_chunks, max_blocks,
        BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk, ROWS=max(1, min(16, 2048 // block_e)),
        TILES=tiles, PREFIX=prefix, num_warps=4,
    )  # fmt: skip
    return MoeAlignment(sorted_pairs, block_expert, p, block_m)
