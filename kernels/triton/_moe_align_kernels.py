"""@triton.jit bodies of kernels/triton/moe_align.py (the wrapper says what they compute
and when each runs). `P` is the number of (token, expert) pairs, T*K in docs/shapes.md.
`align_pairs` and `zero_block` are also called from the MoE prologue's kernel
(_moe_prologue_kernels.py)."""

from __future__ import annotations

import triton
import triton.language as tl


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
