"""Group (token, expert) pairs by expert for the fused MoE kernels.

Legend: T = tokens, A = experts per token (top-k), P = T*A pairs, E = experts,
BM = the kernel's BLOCK_M. Pair p = t*A + a is token t's a-th choice.

The result pads each expert's pairs to a multiple of BM so every BLOCK_M tile of
`sorted_pairs` belongs to one expert. Every size is computed from host-known T, A, E, BM
(never read back from the device), so the step is CUDA-graph capturable and syncs nothing.

Two ways, chosen by P (both also zero an optional float32 buffer the down kernel then
accumulates into, the combine, in extra programs, so that costs no launch of its own):
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
`moe_align_torch` is the plain torch twin; all give the same bits (ranks within an expert
are stable).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.triton._common import check_device, next_pow2

ZERO_BLOCK = 4096  # float32 elements zeroed per extra program
# From this many pairs the place kernel's programs read a prefix sum of the chunk counts
# (one cumsum launch) instead of each summing the counts of every chunk: at 4096 pairs and
# 64 experts that loop reads 64 rows per program, 64 programs; at a 16K-token prefill's
# 98K pairs it would read 1,536 rows in each of 1,536 programs.
PREFIX_MIN_PAIRS = 4096


@dataclass
class MoeAlignment:
    sorted_pairs: torch.Tensor  # [max_padded] int32: pair ids grouped by expert, pad = P
    block_expert: torch.Tensor  # [max_blocks] int32: expert of each BM tile, -1 = unused
    num_pairs: int  # P
    block_m: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """At most min(E, P) experts are hit, each padding at most BM-1 slots."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


@triton.jit
def moe_align_kernel(
    # pointers
    ids_ptr,  # [P] expert of each pair
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 out
    block_expert_ptr,  # [max_blocks] int32 out
    zero_ptr,  # [n_zero] float32 out, zeroed by programs 1..
    # sizes
    P,
    E,
    max_blocks,
    n_zero,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,  # pairs per step of the count and scatter loops
    TILES: tl.constexpr,  # tiles per step of the map loop
    ZBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid > 0:
        zero_block(zero_ptr, pid - 1, n_zero, ZBLOCK)
        return
    align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, P, E, max_blocks,
                BLOCK_M, BLOCK_E, CHUNK, TILES, "")  # fmt: skip


@triton.jit
def zero_block(zero_ptr, block, n_zero, ZBLOCK: tl.constexpr):
    """Zero elements [block * ZBLOCK, (block + 1) * ZBLOCK) of a float32 buffer."""
    offs_z = block.to(tl.int64) * ZBLOCK + tl.arange(0, ZBLOCK)
    tl.store(zero_ptr + offs_z, tl.zeros((ZBLOCK,), tl.float32), mask=offs_z < n_zero)


@triton.jit
def align_pairs(
    ids_ptr,
    sorted_ptr,
    block_expert_ptr,
    P,
    E,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    TILES: tl.constexpr,
    IDS_CACHE: tl.constexpr,  # ".cg" where another program of the launch wrote the ids
):
    """The whole grouping in one program: sorted_pairs and block_expert from the P ids."""
    offs_e = tl.arange(0, BLOCK_E)
    # 1. counts per expert: a [CHUNK, BLOCK_E] one-hot per chunk of pairs.
    counts = tl.zeros((BLOCK_E,), tl.int32)
    for c0 in range(0, P, CHUNK):
        offs_p = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1, cache_modifier=IDS_CACHE)
        onehot = (ids.to(tl.int32)[:, None] == offs_e[None, :]).to(tl.int32)
        counts += tl.sum(onehot, axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)  # experts >= E have 0 pairs: end = total
    padded_start = padded_end - padded
    fill_end = padded_start + counts  # slots [fill_end, padded_end) of an expert are pads
    # 2. tile -> expert (searchsorted of the tile start in padded_end, -1 past the end), and
    # the pad slots: each tile's slots from its expert's last pair on.
    for t0 in range(0, max_blocks, TILES):
        tiles = t0 + tl.arange(0, TILES)
        in_range = tiles < max_blocks
        expert = tl.sum((padded_end[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + tiles, tl.where(expert < E, expert, -1), mask=in_range)
        # experts past the last one: end = total (E < BLOCK_E) or 0 (no match): all pads
        end = tl.sum(tl.where(offs_e[None, :] == expert[:, None], fill_end[None, :], 0), axis=1)
        slots = tiles[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + slots, tl.zeros((TILES, BLOCK_M), tl.int32) + P,
                 mask=in_range[:, None] & (slots >= end[:, None]))  # fmt: skip
    # 3. scatter each pair to its expert's start + its rank among that expert's earlier
    # pairs (stable: pair order kept within an expert). Pads and pairs are disjoint slots.
    running = tl.zeros((BLOCK_E,), tl.int32)
    for c0 in range(0, P, CHUNK):
        offs_p = c0 + tl.arange(0, CHUNK)
        mask_p = offs_p < P
        ids = tl.load(ids_ptr + offs_p, mask=mask_p, other=-1, cache_modifier=IDS_CACHE)
        onehot = (ids.to(tl.int32)[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        before = tl.cumsum(onehot, axis=0) - onehot  # same-expert pairs earlier in the chunk
        slot = (padded_start + running)[None, :] + before
        dest = tl.sum(tl.where(onehot == 1, slot, 0), axis=1)
        tl.store(sorted_ptr + dest, offs_p, mask=mask_p)
        running += tl.sum(onehot, axis=0)


@triton.jit
def moe_count_kernel(
    ids_ptr,  # [P] expert of each pair
    chunk_counts_ptr,  # [BLOCK_E, n_chunks] int32 out: pairs per expert in each chunk
    zero_ptr,  # [n_zero] float32 out, zeroed by programs n_chunks..
    P,
    n_chunks,
    n_zero,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    ZBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid >= n_chunks:
        zero_block(zero_ptr, pid - n_chunks, n_zero, ZBLOCK)
        return
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = pid * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1).to(tl.int32)
    counts = tl.sum((ids[:, None] == offs_e[None, :]).to(tl.int32), axis=0)
    tl.store(chunk_counts_ptr + offs_e * n_chunks + pid, counts)


@triton.jit
def moe_place_kernel(
    ids_ptr,  # [P]
    chunk_counts_ptr,  # [BLOCK_E, n_chunks] int32 from moe_count_kernel
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 out
    block_expert_ptr,  # [max_blocks] int32 out
    P,
    E,
    n_chunks,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    ROWS: tl.constexpr,  # chunk-count rows summed per loop step
    TILES: tl.constexpr,  # tiles mapped per map program
    PREFIX: tl.constexpr,  # chunk_counts holds inclusive prefix sums over the chunks
):
    pid = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    # Every program needs the padded starts; a chunk's program also the pairs of each
    # expert in the chunks before it.
    if PREFIX:
        row = chunk_counts_ptr + offs_e * n_chunks
        counts = tl.load(row + n_chunks - 1)
        prev = tl.minimum(tl.maximum(pid - 1, 0), n_chunks - 1)  # in bounds for every pid
        before_chunk = tl.load(row + prev)
        before_chunk = tl.where((pid > 0) & (pid < n_chunks), before_chunk, 0)
    else:
        counts = tl.zeros((BLOCK_E,), tl.int32)
        before_chunk = tl.zeros((BLOCK_E,), tl.int32)
        for r0 in range(0, n_chunks, ROWS):
            rows = r0 + tl.arange(0, ROWS)
            cc = tl.load(chunk_counts_ptr + rows[:, None] + offs_e[None, :] * n_chunks,
                         mask=(rows < n_chunks)[:, None], other=0)  # fmt: skip
            counts += tl.sum(cc, axis=0)
            before_chunk += tl.sum(tl.where((rows < pid)[:, None], cc, 0), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)  # experts >= E have 0 pairs: end = total
    padded_start = padded_end - padded
    if pid < n_chunks:
        # Scatter this chunk's pairs: expert start + pairs of earlier chunks + rank here.
        offs_p = pid * CHUNK + tl.arange(0, CHUNK)
        mask_p = offs_p < P
        ids = tl.load(ids_ptr + offs_p, mask=mask_p, other=-1).to(tl.int32)
        onehot = (ids[:, None] == offs_e[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        before = tl.cumsum(onehot, axis=0) - onehot
        slot = (padded_start + before_chunk)[None, :] + before
        dest = tl.sum(tl.where(onehot == 1, slot, 0), axis=1)
        tl.store(sorted_ptr + dest, offs_p, mask=mask_p)
    else:
        # Map TILES tiles to their expert (-1 past the last) and write their pad slots.
        tiles = (pid - n_chunks) * TILES + tl.arange(0, TILES)
        in_range = tiles < max_blocks
        expert = tl.sum((padded_end[None, :] <= (tiles * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + tiles, tl.where(expert < E, expert, -1), mask=in_range)
        fill_end = padded_start + counts  # an expert's slots from here to its end are pads
        end = tl.sum(tl.where(offs_e[None, :] == expert[:, None], fill_end[None, :], 0), axis=1)
        slots = tiles[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + slots, tl.zeros((TILES, BLOCK_M), tl.int32) + P,
                 mask=in_range[:, None] & (slots >= end[:, None]))  # fmt: skip


def moe_align(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    zero: torch.Tensor | None = None,
) -> MoeAlignment:
    """topk_ids [T, A] (any int dtype, values in [0, E)) -> MoeAlignment, in one launch, or
    two (three from PREFIX_MIN_PAIRS pairs) over chunks of pairs. `zero` (a contiguous
    float32 tensor, e.g. the combine's accumulator) is zeroed by the same launches."""
    assert topk_ids.dim() == 2, f"topk_ids must be [T, A], got {list(topk_ids.shape)}"
    assert zero is None or (zero.dtype == torch.float32 and zero.is_contiguous()), (
        "zero must be a contiguous float32 tensor"
    )
    check_device(topk_ids)
    device = topk_ids.device
    flat = topk_ids.reshape(-1)  # [P]
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


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """The torch twin of `moe_align` (a chain of small ops, no host sync)."""
    assert topk_ids.dim() == 2, f"topk_ids must be [T, A], got {list(topk_ids.shape)}"
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    p = flat.numel()
    max_padded = max_padded_pairs(p, num_experts, block_m)
    max_blocks = -(-max_padded // block_m)
    # bincount would sync (it reads max() back); scatter_add into E bins does not.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert
    expert_of = flat[order]
    rank = torch.arange(p, device=device) - count_start[expert_of]
    dest = padded_start[expert_of] + rank  # [P]
    sorted_pairs = torch.full((max_blocks * block_m,), p, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # [max_blocks]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoeAlignment(sorted_pairs, block_expert, p, block_m)
