"""Batch-invariant MLA prefill attention: each prompt query gets exactly the decode kernel's
arithmetic (kernels/triton/mla_decode.py: its own split count from its own causal length,
the same 32-slot tiles from each split's start, the same online-softmax updates and merge),
so its result is the bits a decode step of that query would give, while a program holds a
tile of `q_tile` consecutive queries of one sequence and reads each cache tile once for all
of them (the decode kernel, one query a program, re-reads a sequence's cache once per
query: a prompt of L tokens reads its cache ~L / 2 times).

That a row of `tl.dot`'s result has the same bits whatever the tile's row count was checked
on the H200 for these shapes (docs/notes-vllm-peer.md); this kernel as a whole has been
checked against the decode kernel under TRITON_INTERPRET=1 (tests/kernels/test_mla_prefill.py)
and on the H200 (scripts/gpu_mla_prefill_check.py); the engine's batch-invariant prefill
runs it (engine/backends/cuda/mla.py).

Legend: docs/shapes.md. q_c [T, H, R], q_rope [T, H, P], kv_cache [blocks, block_size,
R + P]; block_tables [S, max_blocks] one row per sequence; query_lens [S] on the host (the
step's rows are each sequence's queries in order); context_lens [T] on the device (each
query's position + 1). Returns [T, H, R] in q_c's dtype.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, interpreting, next_pow2
from kernels.triton._mla_prefill_kernels import mla_prefill_kernel
from kernels.triton.mla_decode import default_num_warps

# Query rows per launch: the split partials' buffer grows with the rows.
ROWS_PER_LAUNCH = 256


def query_tiles(query_lens: list[int], q_tile: int) -> list[tuple[int, int, int]]:
    """(first row, rows, sequence) of each tile: every sequence's queries cut into runs of
    at most q_tile, never across sequences."""
    tiles, row = [], 0
    for seq, n in enumerate(query_lens):
        for start in range(0, n, q_tile):
            tiles.append((row + start, min(q_tile, n - start), seq))
        row += n
    return tiles


def prefill_launches(
    query_lens: list[int], q_tile: int, device
) -> list[tuple[int, int, torch.Tensor]]:
    """(first row, rows, tile table [3, tiles] on `device`) of each launch: whole tiles,
    ~ROWS_PER_LAUNCH rows a launch. Every layer of a step launches the same way, so a
    caller computes this once per step (the tables cross to the device once)."""
    tiles = query_tiles(query_lens, q_tile)
    launches = []
    for start in range(0, len(tiles), max(1, ROWS_PER_LAUNCH // q_tile)):
        group = tiles[start : start + max(1, ROWS_PER_LAUNCH // q_tile)]
        first_row = group[0][0]
        rows = group[-1][0] + group[-1][1] - first_row
        meta = torch.tensor([[f - first_row, n, s] for f, n, s in group], dtype=torch.int32)
        launches.append((first_row, rows, meta.t().contiguous().to(device, non_blocking=True)))
    return launches


def mla_prefill(
    q_c: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: list[int],
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    q_tile: int = 4,
    value_blocks: int = 2,
    block_t: int = 32,
    launches: list | None = None,
) -> torch.Tensor:
    """See the module docstring. `num_splits`: the decode kernel's launch constant (the most
    splits any query may use, as the decode graphs capture it); the result matches the
    decode kernel's for the same value. `launches`: prefill_launches(query_lens, q_tile)
    where the caller has it already."""
    T, heads, kvl = q_c.shape
    r = q_rope.shape[-1]
    assert sum(query_lens) == T, f"query_lens sum to {sum(query_lens)}, not the {T} rows"
    assert block_tables.shape[0] == len(query_lens), "one block-table row per sequence"
    assert context_lens.shape == (T,), f"context_lens must be [{T}]"
    assert kv_cache.shape[-1] == kvl + r and kvl % value_blocks == 0
    assert q_tile >= 1 and q_tile == next_pow2(q_tile), f"q_tile must be a power of 2, got {q_tile}"
    check_device(q_c, q_rope, kv_cache, block_tables, context_lens)
    out = torch.empty((T, heads, kvl), dtype=q_c.dtype, device=q_c.device)
    if launches is None:
        launches = prefill_launches(query_lens, q_tile, q_c.device)
    grid_hv = triton.cdiv(heads, 16) * value_blocks
    for first_row, rows, meta in launches:
        sl = slice(first_row, first_row + rows)
        _launch(q_c[sl], q_rope[sl], kv_cache, block_tables, context_lens[sl], out[sl], meta,
                scale, num_splits, q_tile, value_blocks, block_t, grid_hv)  # fmt: skip
    return out


def _launch(q_c, q_rope, kv_cache, block_tables, context_lens, out, meta, scale, num_splits,
            q_tile, value_blocks, block_t, grid_hv):  # fmt: skip
    rows, heads, kvl = q_c.shape
    n_tiles = meta.shape[1]
    if num_splits > 1:
        o_part = torch.empty((rows, heads, num_splits, kvl), dtype=torch.float32, device=q_c.device)
        lse = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=q_c.device)
        counters = arrival_counters(q_c.device, n_tiles * grid_hv)
    else:
        o_part = lse = counters = out
    mla_prefill_kernel[(n_tiles, grid_hv, num_splits)](
        q_c, q_rope, kv_cache, block_tables, context_lens, meta[0], meta[1], meta[2],
        out, o_part, lse, counters, heads, float(scale),
        q_c.stride(0), q_c.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2) if num_splits > 1 else 0,
        lse.stride(0), lse.stride(1),
        KVL=kvl, R=q_rope.shape[-1], BS=kv_cache.shape[1], NUM_SPLITS=num_splits,
        BLOCK_S=next_pow2(num_splits), MERGE_UNROLL=min(4, num_splits),
        BLOCK_H=16, BLOCK_T=block_t, BLOCK_V=kvl // value_blocks, Q_TILE=q_tile,
        F32_DOT=interpreting(), num_warps=default_num_warps(kvl, num_splits), num_stages=2,
    )  # fmt: skip
