"""Tuning the batch-invariant linears: one launch config per weight shape, used at every
row count, so a row's bits do not depend on its batch (docs/batch-invariance.md).

The plain matmul (kernels/triton/matmul.py: lm_head, bf16 weights, MLA's per-head products)
and the FP8 block-scaled dot kernel (kernels/triton/fp8_linear.py) are timed at the row
counts decode steps take, each call on its own weight copy in one CUDA graph (a step reads
its layers' weights from HBM). The config kept for a shape is the one whose time, relative
to the fastest candidate at each row count, sums least over the row counts: no single row
count may buy its speed with the others'. The keeper is checked to give a row the same bits
alone and among many rows before it is written. Then, since a row's bits depend on BLOCK_K
and the K split alone, the tiles are tuned again at each of a few small row counts with
those held (a decode step of a few rows needs narrow column tiles to give every SM work),
and kept only where every output element equals the shape's own tiles' to the bit.
"""

from __future__ import annotations

import functools
import itertools
import json

import torch

from kernels.triton import fp8_linear, matmul
from kernels.triton._common import sm_count
from kernels.triton.configs import TILE_KEYS
from kernels.tune.timing import time_chain

ROWS = (1, 8, 64, 256, 1024)
# Row counts whose tiles are tuned apart, with the shape's BLOCK_K and K split held: a call
# takes the tiles of the smallest of these at or above its row count
# (configs.with_row_tiles), the shape's own tiles above them.
TILE_ROWS = (1, 8, 32, 128)
SPLITS = (1, 2, 4, 8, 16)
L2_BYTES = 100 << 20  # weight copies per shape: together past the H200's 50 MB L2


def matmul_candidates(n: int, k: int, dtype: torch.dtype, device: torch.device) -> list[dict]:
    base = matmul.heuristic_config(n, k, dtype, device)
    steps = -(-k // (32 if dtype == torch.float32 else 64))
    block_k = 32 if dtype == torch.float32 else 64
    tiles = [(16, 64, 2 * block_k, 4, 4), (16, 128, 2 * block_k, 4, 4), (32, 128, block_k, 4, 3),
             (64, 64, block_k, 4, 3), (64, 128, block_k, 4, 3)]  # fmt: skip
    out = [base]
    for (bm, bn, bk, warps, stages), split in itertools.product(tiles, SPLITS):
        if _split_fits(split, steps, n, bn, device):
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
                            num_warps=warps, num_stages=stages))  # fmt: skip
    return _unique(out)


def fp8_candidates(n: int, k: int, device: torch.device) -> list[dict]:
    base = fp8_linear.heuristic_fixed_config(n, k, device)
    steps = -(-k // 128)
    out = [base]
    for (bm, bn, warps, stages), split in itertools.product(
        ((16, 64, 4, 4), (16, 128, 4, 4), (32, 128, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3)),
        SPLITS,
    ):  # fmt: skip
        if _split_fits(split, steps, n, bn, device):
            out.append(dict(KERNEL="dot", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, SPLIT_K=split,
                            num_warps=warps, num_stages=stages))  # fmt: skip
    return _unique(out)


def tile_candidates(m: int, cfg: dict) -> list[dict]:
    """Tiles for an M-row call, the shape's own first: row tiles no taller than M needs
    (16, MMA's smallest, at the least), 16 to 128 columns, a deeper pipeline where the
    call is a few rows streaming its weight."""
    heights = (16,) if m <= 16 else (16, 32) if m <= 32 else (32, 64)
    stages = 4 if m <= 32 else 3
    out = [{key: cfg[key] for key in TILE_KEYS}]
    for bm, bn in itertools.product(heights, (16, 32, 64, 128)):
        out.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=4, num_stages=stages))
    return _unique(out)


def _split_fits(split: int, steps: int, n: int, block_n: int, device: torch.device) -> bool:
    """A K split leaves each split two BLOCK_K steps or more, and is large only where the
    column tiles alone would leave SMs idle (the router's 64 experts: one tile)."""
    if split == 1:
        return True
    return steps // split >= 2 and -(-n // block_n) * split <= 4 * sm_count(device)


def _unique(configs: list[dict]) -> list[dict]:
    seen, out = set(), []
    for cfg in configs:
        key = json.dumps(cfg, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


def _copies(nbytes: int) -> int:
    return max(1, min(16, L2_BYTES // max(1, nbytes)))


def tune_matmul(n: int, k: int, dtype: torch.dtype, device: torch.device, rows=ROWS,
                tile_rows=TILE_ROWS, keep: dict | None = None) -> dict:  # fmt: skip
    """The kept config for x [M, K] @ w [N, K]^T and the times behind it. `keep`: a config
    whose BLOCK_K and K split stay as they are (only the row-count tiles are tuned)."""
    weights = [torch.randn(n, k, device=device).to(dtype) for _ in range(_copies(2 * n * k))]
    x = torch.randn(max(*rows, *tile_rows), k, device=device).to(dtype)
    xs = {m: x[:m] for m in range(1, x.shape[0] + 1)}  # the same leading rows at every M

    def call(cfg, m, w):
        return matmul.fixed_linear(xs[m], w, config=cfg)

    def reference(m, w):
        return torch.nn.functional.linear(xs[m], w)

    cands = matmul_candidates(n, k, dtype, device)
    return _tune(cands, rows, tile_rows, keep, weights, call, reference)


def tune_fp8(n: int, k: int, device: torch.device, rows=ROWS, tile_rows=TILE_ROWS,
             keep: dict | None = None) -> dict:  # fmt: skip
    """The kept config for the FP8 block-scaled linear [N, K] under bf16 activations."""
    scale_shape = (-(-n // 128), -(-k // 128))
    weights = [
        (torch.randn(n, k, device=device).to(torch.float8_e4m3fn),
         torch.rand(scale_shape, device=device) / 64)
        for _ in range(_copies(n * k))
    ]  # fmt: skip
    x = torch.randn(max(*rows, *tile_rows), k, device=device).to(torch.bfloat16)
    xs = {m: x[:m] for m in range(1, x.shape[0] + 1)}

    def call(cfg, m, w):
        return fp8_linear.fp8_block_linear(xs[m], w[0], w[1], False, config=cfg)

    return _tune(fp8_candidates(n, k, device), rows, tile_rows, keep, weights, call, None)


def _tune(candidates, rows, tile_rows, keep, weights, call, reference) -> dict:
    """The shape's config (`keep`, or the best-ranked invariant candidate) with its tiles
    tuned at `tile_rows`."""
    if keep is not None:
        config = {key: value for key, value in keep.items() if key != "TILES"}
        result = {"kept_from_table": True}
    else:
        result = _search(candidates, rows, weights, call, reference)
        config = result["config"]
    tiles, tiles_us = _tune_tiles(config, tile_rows, weights, call)
    result["config"] = {**config, "TILES": tiles} if tiles else config
    result["tiles_us"] = tiles_us
    return result


def _tune_tiles(cfg: dict, tile_rows, weights, call) -> tuple[dict, dict]:
    """At each row count, the fastest tile candidate whose output equals cfg's own tiles'
    to the bit at every row count it will serve (those above the next smaller tuned count,
    up to this one); an entry only where that is not cfg's own tiles."""
    tiles, report, below = {}, {}, 0
    for m in sorted(tile_rows):
        served, below = range(below + 1, m + 1), m
        own = {r: call(cfg, r, weights[0]) for r in served}
        times, differ = {}, 0
        for cand in tile_candidates(m, cfg):
            trial = {**cfg, **cand}
            try:
                if not all(torch.equal(call(trial, r, weights[0]), own[r]) for r in served):
                    differ += 1
                    continue
                chain = [functools.partial(call, trial, m, w) for w in weights]
                times[json.dumps(cand, sort_keys=True)] = time_chain(chain, 5, 30)
            except Exception as err:  # a config can exceed registers or shared memory
                print(f"  skip {cand} at {m} rows: {type(err).__name__}: {str(err)[:80]}")
        del own
        own_key = json.dumps({key: cfg[key] for key in TILE_KEYS}, sort_keys=True)
        best = min(times, key=times.get)
        if best != own_key:
            tiles[str(m)] = json.loads(best)
        report[m] = {"tiles": json.loads(best), "us": round(1e3 * times[best], 2),
                     "own_tiles_us": round(1e3 * times[own_key], 2),
                     "serves_rows": [served.start, served.stop - 1],
                     "candidates_with_other_bits": differ}  # fmt: skip
    return tiles, report


def _search(candidates, rows, weights, call, reference) -> dict:
    times: dict[str, dict[int, float]] = {}
    for cfg in candidates:
        key = json.dumps(cfg, sort_keys=True)
        try:
            times[key] = {
                m: time_chain([functools.partial(call, cfg, m, w) for w in weights], 5, 30)
                for m in rows
            }
        except Exception as err:  # a config can exceed registers or shared memory
            print(f"  skip {cfg}: {type(err).__name__}: {str(err)[:80]}")
    best_at = {m: min(t[m] for t in times.values()) for m in rows}

    def cost(key):
        return sum(times[key][m] / best_at[m] for m in rows)

    ranked = sorted(times, key=cost)
    kept = next((key for key in ranked if _invariant(json.loads(key), rows, weights, call)), None)
    if kept is None:
        raise RuntimeError("no candidate gave a row the same bits at every row count")
    heuristic = json.dumps(candidates[0], sort_keys=True)
    result = {
        "config": json.loads(kept),
        "us": {m: round(1e3 * times[kept][m], 2) for m in rows},
        "heuristic_us": {m: round(1e3 * times[heuristic][m], 2) for m in rows}
        if heuristic in times
        else None,
        "best_per_row_count_us": {m: round(1e3 * best_at[m], 2) for m in rows},
        "relative_cost": round(cost(kept) / len(rows), 3),
        "candidates": len(times),
    }
    if reference is not None:
        result["torch_us"] = {
            m: round(
                1e3 * time_chain([functools.partial(reference, m, w) for w in weights], 5, 30), 2
            )
            for m in rows
        }
    return result


def _invariant(cfg: dict, rows, weights, call) -> bool:
    """Every row of each smaller call equal, bit for bit, to the same row computed among the
    most rows (a row's position in its tile must not change its bits either)."""
    w = weights[0]
    most = call(cfg, max(rows), w)
    return all(torch.equal(call(cfg, m, w), most[:m]) for m in rows)
