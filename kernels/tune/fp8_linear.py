"""Tuning the FP8 block-scaled linear (kernels/triton/fp8_linear.py) for one (M, N, K):
the heuristic, tl.dot configs (both orientations) and, without native FP8 up to GEMV_MAX_M
rows, the GEMV's tiles, then its K splits and decode on the best tile. Each config is timed
as a chain of calls over weight copies that together exceed the L2, in one CUDA graph (as
in a decode step, where each layer's weights come from HBM)."""

from __future__ import annotations

import functools
import itertools
import json
import math

import torch

from kernels.triton.fp8_linear import (
    GEMV_MAX_M,
    default_config,
    default_gemv_config,
    fp8_block_linear,
)
from kernels.tune.timing import time_chain


def chain_ms(x: torch.Tensor, weights: list, native: bool, cfg: dict, warm: bool = True) -> float:
    """ms per fp8_block_linear call on x, each on its own (codes, scales) copy of `weights`,
    chained in one graph."""
    calls = [functools.partial(fp8_block_linear, x, w, ws, native, config=cfg) for w, ws in weights]
    return time_chain(calls, warmup_ms=25 if warm else 5, rep_ms=150 if warm else 30)


def tune(x: torch.Tensor, weights: list, native: bool) -> dict:
    """The fastest config for x [M, K] times the [N, K] weights, over `weights` (copies of
    one matrix: [(codes, scales)]). A config that fails to compile or launch is skipped."""
    m, device = x.shape[0], x.device
    n, k = weights[0][0].shape
    timed: dict[str, float] = {}

    def ms(cfg: dict) -> float:
        key = json.dumps(cfg, sort_keys=True)
        if key not in timed:
            try:
                timed[key] = chain_ms(x, weights, native, cfg, warm=False)
            except Exception as err:  # a config can exceed registers or shared memory
                print(f"  skip {cfg}: {type(err).__name__}")
                timed[key] = float("inf")
        return timed[key]

    base = default_config(m, n, k, device, native)
    cands = [base] + dot_candidates(m, base, device)
    if not native and m <= GEMV_MAX_M:
        # The last four take a row block's whole K (up to 2048) in one or two steps: every
        # load of a program in flight at once and no split-K partials, where the others
        # keep two steps in flight (an Nsight Compute profile of the 3648 x 2048 GEMV at
        # one token found DRAM read at 19% of its peak, its 912 programs mostly waiting).
        gemv = default_gemv_config(m, n, k, device)
        tiles = [dict(gemv, BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
                 for bn, bk, w in ((16, 256, 4), (16, 512, 4), (32, 128, 4), (32, 256, 4),
                                   (64, 128, 4), (32, 512, 8), (8, 1024, 4), (8, 2048, 4),
                                   (16, 1024, 4), (16, 1024, 8))]  # fmt: skip
        best_tile = min(tiles, key=ms)
        k_steps = math.ceil(k / best_tile["BLOCK_K"])
        splits = [sp for sp in (1, 2, 4, 6, 8, 16) if sp <= k_steps]
        cands += tiles + [dict(best_tile, SPLIT_K=sp, BIT_DECODE=bit)
                          for sp, bit in itertools.product(splits, (False, True))]  # fmt: skip
    best = min(cands, key=ms)
    by_kernel: dict[str, tuple[float, dict]] = {}
    for cfg in cands:
        kind = cfg.get("KERNEL", "dot") + (" swap" if cfg.get("SWAP_AB") else "")
        by_kernel[kind] = min(
            by_kernel.get(kind, (math.inf, cfg)), (ms(cfg), cfg), key=lambda p: p[0]
        )
    for kind, (t, cfg) in sorted(by_kernel.items(), key=lambda p: p[1][0]):
        print(f"  M={m} {n}x{k}{' native' if native else ''} best {kind}: {t * 1e3:.1f} us {cfg}")
    return best


def dot_candidates(m: int, base: dict, device: torch.device) -> list[dict]:
    """tl.dot configs (the GEMV's are swept in `tune`)."""
    dot = base if base.get("KERNEL") == "dot" else default_config(32, 1, 1, device)
    out = [dot]
    if m <= 32:
        for bn, split, stages in itertools.product((32, 64, 128), (1, 2, 4, 8), (4,)):
            out.append(dict(dot, BLOCK_N=bn, SPLIT_K=split, num_stages=stages))
    else:
        for bm, bn, warps in itertools.product((64, 128), (128, 256), (4, 8)):
            out.append(dict(dot, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, SPLIT_K=1))
    # SWAP_AB: decoded weights as wgmma's register operand (64 rows per warpgroup), the
    # tokens as its N side
    swap = dict(dot, SWAP_AB=True, BLOCK_K=128, num_warps=4, num_stages=3)
    if m <= 32:
        bm = 16 if m <= 16 else 32
        out += [dict(swap, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=split, num_stages=stages)
                for bn, split, stages in itertools.product((64, 128), (1, 2, 4), (3, 5))]  # fmt: skip
    else:
        out += [dict(swap, BLOCK_M=bm, BLOCK_N=bn, SPLIT_K=1, num_stages=stages)
                for bm, bn, stages in itertools.product((64, 128), (64, 128), (3, 4))]  # fmt: skip
    return out
