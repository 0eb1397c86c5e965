"""Tuning the fused MoE (kernels/triton/fused_moe.py) for one shape: candidate configs
around the heuristic's, each timed alone as CUDA graph replays over several routings (so
the touched experts change between calls and the L2 does not serve them), then the down
launch's own tile, then at prefill sizes the launch order's groups."""

from __future__ import annotations

import functools
import itertools

import torch

from kernels.triton.fused_moe import default_config, down_config, fused_moe
from kernels.tune.timing import fastest, graphed, median_ms

# Token counts above which the prefill-shaped candidates are taken.
PREFILL_TOKENS = 256
# Token counts up to which the MXFP4 int8 kernels are offered (one pair per program).
INT8_MAX_TOKENS = 8


def tune(
    x: torch.Tensor,
    weights: tuple,
    routings: list[tuple[torch.Tensor, torch.Tensor]],
    fmt: str,
    int8: bool = False,
) -> dict:
    """The fastest config for fused_moe on x [T, D] with weights (w13, w2, w13_scale,
    w2_scale) over `routings` [(topk_weights, topk_ids)], each call replayed from its own
    CUDA graph. `int8`: the MXFP4 int8 kernels are candidates too (int8 activations)."""
    w13, w2, s13, s2 = weights
    t, num_experts = x.shape[0], w13.shape[0]
    top_k = routings[0][1].shape[1]
    base = default_config(t * top_k, num_experts, fmt)
    if t > PREFILL_TOKENS:
        cands = prefill_candidates(base)
        if fmt == "mxfp4":  # or decode the experts to bf16 once (mxfp4_dequant)
            bf16 = default_config(t * top_k, num_experts, "bf16")
            cands += [dict(c, KERNEL="dequant") for c in prefill_candidates(bf16)]
    elif fmt == "mxfp4":
        cands = mxfp4_candidates(base, t, int8)
    else:
        cands = moe_candidates(base, fmt)

    def time_cfg(cfg: dict) -> float:
        calls = [
            functools.partial(fused_moe, x, w13, w2, w, ids, fmt=fmt, w13_scale=s13,
                              w2_scale=s2, config=cfg)
            for w, ids in routings
        ]  # fmt: skip
        return median_ms(graphed(calls), warmup_ms=5, rep_ms=30)

    cfg = fastest(time_cfg, cands)
    cfg = fastest(time_cfg, [cfg] + down_candidates(cfg))  # then the down's own tile
    if t > PREFILL_TOKENS:  # then the launch order's groups (_tile_ids)
        cfg = fastest(time_cfg, [cfg] + [dict(cfg, GROUP_M=g) for g in (1, 2, 4, 8, 16)])
    return cfg


def moe_candidates(base: dict, fmt: str) -> list[dict]:
    """bf16 / FP8 at decode sizes: N tiles and stages, K splits of the down, SWAP_AB tiles."""
    out = [base]
    for bn, stages, warps in itertools.product((32, 64, 128), (3, 5), (4,)):
        out.append(dict(base, BLOCK_N=bn, num_stages=stages, num_warps=warps))
    return out + split_candidates(base) + swap_candidates(base, fmt)


def down_candidates(best: dict) -> list[dict]:
    """Second stage: the winner with a tile of the down launch's own (fused_moe's DOWN):
    other row tiles and K splits for the MMA kernels, row tiles and warps for the int8
    ones. One config for both launches has to suit gate+up, which has ~twice the rows."""
    if best.get("KERNEL") == "int8":
        grid = [dict(BLOCK_N=bn, num_warps=w) for bn, w in itertools.product((32, 64, 128), (4, 8))]
    else:
        row_tiles = (64, 128) if down_config(best).get("SWAP_AB") else (32, 64, 128)
        grid = [dict(BLOCK_N=bn, SPLIT_K=sp) for bn, sp in itertools.product(row_tiles, (1, 2, 4))]
    same = down_config(best)
    return [dict(best, DOWN=d) for d in grid if any(same.get(k, 1) != v for k, v in d.items())]


def split_candidates(base: dict) -> list[dict]:
    """The down GEMM split along K (its partials meet in the atomic combine)."""
    return [dict(base, SPLIT_K=split) for split in (2, 4)]


def swap_candidates(base: dict, fmt: str) -> list[dict]:
    """Weights as the MMA's row side (SWAP_AB): wgmma needs 64 weight rows per warpgroup,
    so N tiles of 64 or 128; the K step sets the bytes each step stages (FP8's must divide
    its 128-wide scale blocks)."""
    ks = {"bf16": (64, 128), "fp8": (64, 128), "mxfp4": (128, 256)}[fmt]
    out = [dict(base, SWAP_AB=True, BLOCK_N=bn, BLOCK_K=bk, num_stages=st)
           for bn, bk, st in itertools.product((64, 128), ks, (3, 4))]  # fmt: skip
    best_guess = dict(base, SWAP_AB=True, BLOCK_N=64, BLOCK_K=ks[0], num_stages=3)
    out += [dict(best_guess, SPLIT_K=split) for split in (2, 4)]
    # gate+up split along D too (few tokens: more programs streaming weights)
    out += [dict(best_guess, GU_SPLIT_K=gu, SPLIT_K=split)
            for gu, split in itertools.product((2, 4), (2, 4))]  # fmt: skip
    out.append(dict(best_guess, BLOCK_N=128, num_warps=8))
    # Taller token tiles: an expert with more tokens than BLOCK_M decodes its weights once
    # per token tile, so large batches may prefer fewer, wider tiles.
    for bm in (32, 64):
        if bm > base["BLOCK_M"]:
            out += [dict(best_guess, BLOCK_M=bm), dict(best_guess, BLOCK_M=bm, num_stages=4)]
    return out


def mxfp4_candidates(base: dict, tokens: int, int8: bool) -> list[dict]:
    """MXFP4: the heuristic's A @ W^T tile (decoded tiles through shared memory), the
    SWAP_AB tiles (decoded tiles straight into wgmma), and with `int8` up to
    INT8_MAX_TOKENS tokens the int8 path (table decode + dp4a, one pair per program). That
    one rounds the activations to int8 per 32 (~1% relative on random weights, against
    ~0.4% for bf16 activations), so it is offered only when asked."""
    a_wt = dict(base, SWAP_AB=False, BLOCK_N=64, BLOCK_K=128)  # the A @ W^T tile
    out = [base, a_wt, dict(a_wt, BLOCK_N=128)]
    if int8 and tokens <= INT8_MAX_TOKENS:
        out += [dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
                for bn, bk, w in itertools.product((32, 64, 128), (128, 256, 512), (4, 8))]  # fmt: skip
    return out + swap_candidates(base, "mxfp4")


def prefill_candidates(base: dict) -> list[dict]:
    """Prefill-sized launches (hundreds of tokens per expert): every token tile reads (and
    for FP8/MXFP4 decodes) the expert's weights again, so taller token tiles do it fewer
    times; the A @ W^T tile stages decoded weights through shared memory once per tile.
    Each tile comes in the plain launch order and in groups of 8 token tiles (_tile_ids)."""
    a_wt = dict(base, SWAP_AB=False)
    out = [base]
    out += [dict(a_wt, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            for bm, bn, w, st in ((64, 128, 4, 3), (128, 64, 4, 3), (128, 128, 8, 3),
                                  (128, 128, 8, 4), (128, 256, 8, 3))]  # fmt: skip
    if base.get("SWAP_AB"):
        out += [dict(base, BLOCK_M=bm, BLOCK_N=bn, num_warps=w)
                for bm, bn, w in ((128, 64, 4), (128, 64, 8), (128, 128, 8), (64, 128, 8))]  # fmt: skip
    # GROUP_M set either way: the heuristic's base may carry its own
    return [dict(c, GROUP_M=g) for g in (1, 8) for c in out]
