"""`batchgen bench kernels`: the fused MoE and FP8 linear kernels at decode shapes, in GB/s
and as a fraction of the device-to-device copy bandwidth measured in the same run, next to
a plain torch implementation of the same op (experts looped and dequantized in bf16; the
FP8 weight dequantized to bf16, then F.linear).

Bytes counted per call: the weights the call touches (each distinct expert's codes and
scales once), the activations read and the output written. Routings rotate among several
random draws so the touched experts change between calls and the L2 (50 MB) does not
serve them. `--tune` sweeps a few launch configs per case, keeps the fastest, and writes
the tables kernels/triton/configs/*.json are made of.

Runs on a CUDA GPU; also `python -m batchgen.bench.kernels` (imports torch, triton, click).
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import click
import torch
import torch.nn.functional as F

from batchgen.bench.common import write_result

ROUTINGS = 8
# --tune sweeps only decode shapes (the bandwidth goals); larger ones keep the heuristic.
TUNE_MAX_TOKENS = 8
# Token counts up to which --tune offers the MXFP4 int8 kernels (one pair per program).
INT8_MAX_TOKENS = 8


@dataclass
class MoeCase:
    name: str
    d: int
    i: int
    e: int
    top_k: int
    fmt: str
    tokens: tuple[int, ...]


MOE_CASES = [
    MoeCase("moonlight-bf16", 2048, 1408, 64, 6, "bf16", (1, 2, 4, 8, 16, 32, 64)),
    MoeCase("moonlight-fp8", 2048, 1408, 64, 6, "fp8", (1, 8, 64)),
    MoeCase("moonlight-mxfp4", 2048, 1408, 64, 6, "mxfp4", (1, 8, 64)),
    MoeCase("deepseek-v3-fp8", 7168, 2048, 256, 8, "fp8", (1, 4, 8, 32, 64)),
    MoeCase("v4-flash-mxfp4", 4096, 2048, 256, 6, "mxfp4", (1, 4, 8, 32, 64)),
    # Moonlight's two shared experts as one (I = 2 x 1408), every token on it: the engine
    # runs it in the fused launches up to 64 tokens, and its tuned entry (E1, A1) is the
    # one fused_moe.dense_config reads. Tuned here it is timed alone; in the step it runs
    # beside the routed kernels, where another tile can win (the H200 table's T1 and T8
    # FP8 entries carry a DOWN tile from the step): tune it with `bench step-tune`.
    MoeCase("moonlight-shared-bf16", 2048, 2816, 1, 1, "bf16", (1, 8, 32, 64)),
    MoeCase("moonlight-shared-fp8", 2048, 2816, 1, 1, "fp8", (1, 8, 32, 64)),
]
# Token counts above which --tune takes the prefill-shaped candidates.
PREFILL_TOKENS = 256
LINEAR_SHAPES = [(18432, 7168), (7168, 18432), (32768, 4096), (4096, 32768)]  # (N, K)
LINEAR_TOKENS = (1, 8, 64, 512)
# The engine's FP8 linears on Moonlight (hidden 2048): q_proj and kv_a (3648 = the two
# stacked, as decode steps on CUDA run them; 3072 and 576 alone in prefill), o_proj, the
# dense MLP's gate+up and down, and the shared expert's gate or up and down (a plain MLP
# above SHARED_FUSED_MAX_TOKENS). Native FP8 rows only with --linear-native.
ENGINE_LINEAR_SHAPES = [(3648, 2048), (3072, 2048), (576, 2048), (2048, 2048), (22528, 2048),
                        (2048, 11264), (2816, 2048), (2048, 2816)]  # fmt: skip
ENGINE_LINEAR_TOKENS = (1, 2, 4, 8, 64)
# Calls are timed as a chain over copies of the weight that together exceed the 50 MB L2
# (as in a decode step, where each layer's weights come from HBM), in one CUDA graph (as
# the engine replays them): per-launch gaps are counted, host launch cost is not.
LINEAR_CHAIN_BYTES = 160e6
LINEAR_CHAIN_MAX = 128


def median_ms(fn, warmup_ms: int = 25, rep_ms: int = 150) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def graphed(calls: list) -> object:
    """Capture each call in its own CUDA graph and return a callable that replays them in
    turn: the engine runs decode as graph replays, so host launch cost is left out here."""
    for call in calls:  # compile and warm up outside capture
        call()
    torch.cuda.synchronize()
    graphs = []
    for call in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        graphs.append(g)
    it = itertools.cycle(graphs)
    return lambda: next(it).replay()


def time_graphed(calls: list) -> float:
    """Median ms per call replayed from CUDA graphs; eager if capture fails (reported)."""
    try:
        return median_ms(graphed(calls))
    except RuntimeError as err:
        print(f"  graph capture failed ({err}); timing eagerly")
        return median_ms(_cycle(calls))


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Device-to-device copy in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3)


def _expert_bytes(case: MoeCase, w13, w2, s13, s2) -> int:
    per = lambda t: 0 if t is None else t[0].numel() * t.element_size()  # noqa: E731
    return per(w13) + per(w2) + per(s13) + per(s2)


def make_moe_weights(case: MoeCase, device):
    from kernels.reference.quant_formats import random_fp8_block, random_mxfp4

    e, d, i = case.e, case.d, case.i
    if case.fmt == "bf16":
        w13 = torch.randn(e, 2 * i, d, device=device, dtype=torch.bfloat16) / math.sqrt(d)
        w2 = torch.randn(e, d, i, device=device, dtype=torch.bfloat16) / math.sqrt(i)
        return w13, w2, None, None
    if case.fmt == "fp8":
        w13, s13 = random_fp8_block((e, 2 * i, d), device=device)
        w2, s2 = random_fp8_block((e, d, i), device=device)
        return w13, w2, s13, s2
    w13, s13 = random_mxfp4((e, 2 * i, d), device=device)
    w2, s2 = random_mxfp4((e, d, i), device=device)
    return w13, w2, s13, s2


def _routings(case: MoeCase, t: int, device):
    out = []
    for _ in range(ROUTINGS):
        scores = torch.rand(t, case.e, device=device)
        w, ids = scores.topk(case.top_k, dim=-1)
        out.append((w / w.sum(-1, keepdim=True), ids.to(torch.int32)))
    return out


def _moe_calls(fn, x, weights, routings, **kw) -> list:
    """One no-argument callable per routing."""
    w13, w2, s13, s2 = weights
    return [
        functools.partial(fn, x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2, **kw)
        for w, ids in routings
    ]


def _cycle(calls: list):
    it = itertools.cycle(calls)
    return lambda: next(it)()


def bench_moe(
    case: MoeCase,
    copy_bps: float,
    device,
    tune: bool,
    tokens: tuple[int, ...] = (),
    tune_max_tokens: int = TUNE_MAX_TOKENS,
    int8: bool = False,
) -> tuple[list[dict], dict]:
    from kernels.reference.fused_moe import fused_moe_reference
    from kernels.triton.fused_moe import choose_config, default_config, fused_moe, shape_key

    weights = make_moe_weights(case, device)
    per_expert = _expert_bytes(case, *weights)
    rows, tuned = [], {}
    for t in tokens or case.tokens:
        x = torch.randn(t, case.d, device=device, dtype=torch.bfloat16)
        routings = _routings(case, t, device)
        distinct = sum(torch.unique(ids).numel() for _, ids in routings) / len(routings)
        nbytes = distinct * per_expert + t * case.d * 2 * 2  # + x read, out written
        # Tuning searches around the heuristic's config; untuned, the bench times the one
        # the engine would launch (the table's entry, else the heuristic).
        if tune and t <= tune_max_tokens:
            cfg = default_config(t * case.top_k, case.e, case.fmt)
            if t > PREFILL_TOKENS:
                cands = _prefill_candidates(cfg)
                if case.fmt == "mxfp4":  # or decode the experts to bf16 once (mxfp4_dequant)
                    bf16 = default_config(t * case.top_k, case.e, "bf16")
                    cands += [dict(c, KERNEL="dequant") for c in _prefill_candidates(bf16)]
            elif case.fmt == "mxfp4":
                cands = _mxfp4_candidates(cfg, t, int8)
            else:
                cands = _moe_candidates(cfg, case.fmt)

            def make(c, x=x, r=routings):
                return graphed(_moe_calls(fused_moe, x, weights, r, fmt=case.fmt, config=c))

            cfg = _tune(make, cands)
            cfg = _tune(make, [cfg] + _down_candidates(cfg))  # then the down's own tile
            if t > PREFILL_TOKENS:  # then the launch order's groups (_tile_ids)
                cfg = _tune(make, [cfg] + [dict(cfg, GROUP_M=g) for g in (1, 2, 4, 8, 16)])
            tuned[shape_key(t, case.top_k, case.e, case.d, case.i, case.fmt)] = cfg
        else:
            cfg = choose_config(t, case.top_k, case.e, case.d, case.i, case.fmt, device)
        calls = _moe_calls(fused_moe, x, weights, routings, fmt=case.fmt, config=cfg)
        ms = time_graphed(calls)
        eager_ms = median_ms(_cycle(calls))
        # The loop over experts reads routing counts back to the host: eager only.
        ref = _moe_calls(fused_moe_reference, x, weights, routings, fmt=case.fmt,
                         compute_dtype=torch.bfloat16)  # fmt: skip
        ref_ms = median_ms(_cycle(ref))
        rows.append(_row("fused_moe", f"{case.name} T={t}", nbytes, ms, ref_ms, copy_bps, cfg))
        rows[-1]["eager_ms"] = eager_ms
        # gate+up and down: 3 D x I multiply-adds per (token, expert) pair
        rows[-1]["tflops"] = 6 * case.d * case.i * t * case.top_k / (ms * 1e-3) / 1e12
        print_rows(rows[-1:])
    return rows, tuned


def bench_linear(
    n: int,
    k: int,
    copy_bps: float,
    device,
    tune: bool,
    tokens: tuple[int, ...] = LINEAR_TOKENS,
    natives: tuple[bool, ...] = (False, True),
    tune_max_tokens: int = TUNE_MAX_TOKENS,
) -> tuple[list[dict], dict]:
    from kernels.reference.quant_formats import dequant_fp8_block, random_fp8_block
    from kernels.triton.fp8_linear import choose_config, default_config, shape_key

    q, s = random_fp8_block((n, k), device=device)
    per_copy = n * k + s.numel() * 4
    copies = max(2, min(LINEAR_CHAIN_MAX, math.ceil(LINEAR_CHAIN_BYTES / per_copy)))
    weights = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
    rows, tuned = [], {}
    for m in tokens:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        nbytes = per_copy + m * k * 2 + m * n * 2
        for native in natives:
            # Untuned: what the engine gets today (the committed table, else the heuristic).
            cfg = choose_config(m, n, k, device, native)
            if tune and m <= tune_max_tokens:
                base = default_config(m, n, k, device, native)
                time_cfg = functools.partial(_time_linear_chain, x, weights, native, warm=False)
                cfg = _tune_linear(time_cfg, base, m, n, k, native)
                tuned[shape_key(m, n, k, native)] = cfg
            ms = _time_linear_chain(x, weights, native, cfg)
            # The same dequantize + F.linear a plain torch layer does, graph-captured too.
            ref_ms = _time_chain(
                [lambda x=x, w=w, ws=ws: F.linear(x, dequant_fp8_block(w, ws).to(torch.bfloat16))
                 for w, ws in weights[:8]]
            )  # fmt: skip
            label = f"{n}x{k} M={m}" + (" native" if native else "")
            row = _row("fp8_linear", label, nbytes, ms, ref_ms, copy_bps, cfg)
            row["tflops"] = 2 * m * n * k / (ms * 1e-3) / 1e12
            row["chain"] = copies
            rows.append(row)
            print_rows([row])
    return rows, tuned


def time_linear_paths(device) -> list[dict]:
    """Each FP8 linear path at decode sizes, by its default config: the GEMV, the tl.dot
    kernel with bf16 decode, and native FP8 (what `fp8_block_linear`'s default choice of
    path rests on). us per call in the same over-L2 graph chains as the other rows."""
    from kernels.reference.quant_formats import random_fp8_block
    from kernels.triton.fp8_linear import default_config, default_gemv_config

    rows = []
    for n, k in ENGINE_LINEAR_SHAPES + LINEAR_SHAPES[:1]:
        q, s = random_fp8_block((n, k), device=device)
        copies = max(2, min(LINEAR_CHAIN_MAX, math.ceil(LINEAR_CHAIN_BYTES / (n * k))))
        weights = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
        for m in (1, 2, 8):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            dot = default_config(16, n, k, device)  # the dot kernel's small-M config
            row = {"n": n, "k": k, "m": m}
            row["gemv_us"] = 1e3 * _time_linear_chain(
                x, weights, False, default_gemv_config(m, n, k, device)
            )
            row["dot_us"] = 1e3 * _time_linear_chain(x, weights, False, dot)
            row["native_us"] = 1e3 * _time_linear_chain(
                x, weights, True, default_config(m, n, k, device, True)
            )
            rows.append(row)
            print(
                f"fp8 linear paths {n}x{k} M={m}: gemv {row['gemv_us']:.1f} us, "
                f"dot {row['dot_us']:.1f} us, native {row['native_us']:.1f} us"
            )
    return rows


def _time_linear_chain(x, weights, native, cfg, warm=True) -> float:
    """ms per fp8_block_linear call, each on its own weight copy, chained in one graph."""
    from kernels.triton.fp8_linear import fp8_block_linear

    calls = [functools.partial(fp8_block_linear, x, w, ws, native, config=cfg) for w, ws in weights]
    return _time_chain(calls, warmup_ms=25 if warm else 5, rep_ms=150 if warm else 30)


def _time_chain(calls: list, warmup_ms: int = 25, rep_ms: int = 150) -> float:
    """Median ms per call of `calls` captured back to back in one CUDA graph."""
    for call in calls:  # compile and allocate outside capture
        call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call in calls:
            call()
    return median_ms(g.replay, warmup_ms=warmup_ms, rep_ms=rep_ms) / len(calls)


def _tune_linear(time_cfg, base: dict, m: int, n: int, k: int, native: bool) -> dict:
    """The fastest config for one (M, N, K): the heuristic, a few dot configs, and for the
    GEMV first the tile (rows x K bytes per step, warps), then split-K and the decode on the
    best tile. time_cfg(cfg) -> ms; a config that fails to compile or launch is skipped."""
    timed: dict[str, float] = {}

    def ms(cfg: dict) -> float:
        key = json.dumps(cfg, sort_keys=True)
        if key not in timed:
            try:
                timed[key] = time_cfg(cfg)
            except Exception as err:  # a config can exceed registers or shared memory
                print(f"  skip {cfg}: {type(err).__name__}")
                timed[key] = float("inf")
        return timed[key]

    from kernels.triton.fp8_linear import GEMV_MAX_M

    cands = [base] + _linear_candidates(m, base)
    if not native and m <= GEMV_MAX_M:
        # The last four take a row block's whole K (up to 2048) in one or two steps: every
        # load of a program in flight at once and no split-K partials, where the others
        # keep two steps in flight (Nsight Compute, session 10: the 3648 x 2048 GEMV at one
        # token read DRAM at 19% of its peak, its 912 programs mostly waiting).
        tiles = [dict(_gemv_base(m, n, k), BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
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


def _gemv_base(m: int, n: int, k: int) -> dict:
    from kernels.triton.fp8_linear import default_gemv_config

    return default_gemv_config(m, n, k, torch.device("cuda"))


def _row(op, case, nbytes, ms, ref_ms, copy_bps, cfg) -> dict:
    gbs = nbytes / (ms * 1e-3) / 1e9
    return dict(op=op, case=case, bytes=int(nbytes), ms=ms, gb_s=gbs,
                copy_frac=gbs * 1e9 / copy_bps, floor_ms=nbytes / copy_bps * 1e3,
                torch_ms=ref_ms, speedup_vs_torch=ref_ms / ms, config=cfg)  # fmt: skip


def _moe_candidates(base: dict, fmt: str) -> list[dict]:
    out = [base]
    for bn, stages, warps in itertools.product((32, 64, 128), (3, 5), (4,)):
        out.append(dict(base, BLOCK_N=bn, num_stages=stages, num_warps=warps))
    return out + _split_candidates(base) + _swap_candidates(base, fmt)


def _down_candidates(best: dict) -> list[dict]:
    """Second stage: the winner with a tile of the down launch's own (fused_moe's DOWN):
    other row tiles and K splits for the MMA kernels, row tiles and warps for the int8
    ones. One config for both launches has to suit gate+up, which has ~twice the rows."""
    from kernels.triton.fused_moe import down_config

    if best.get("KERNEL") == "int8":
        grid = [dict(BLOCK_N=bn, num_warps=w) for bn, w in itertools.product((32, 64, 128), (4, 8))]
    else:
        row_tiles = (64, 128) if down_config(best).get("SWAP_AB") else (32, 64, 128)
        grid = [dict(BLOCK_N=bn, SPLIT_K=sp) for bn, sp in itertools.product(row_tiles, (1, 2, 4))]
    same = down_config(best)
    return [dict(best, DOWN=d) for d in grid if any(same.get(k, 1) != v for k, v in d.items())]


def _split_candidates(base: dict) -> list[dict]:
    """The down GEMM split along K (its partials meet in the atomic combine)."""
    return [dict(base, SPLIT_K=split) for split in (2, 4)]


def _swap_candidates(base: dict, fmt: str) -> list[dict]:
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


def _mxfp4_candidates(base: dict, tokens: int, int8: bool) -> list[dict]:
    """MXFP4: the heuristic's A @ W^T tile (decoded tiles through shared memory), the
    SWAP_AB tiles (decoded tiles straight into wgmma), and with `int8` up to 8 tokens the
    int8 path (table decode + dp4a, one pair per program). That one rounds the activations
    to int8 per 32 (~1% relative on random weights, against ~0.4% for bf16 activations), so
    the tuner offers it only when asked."""
    a_wt = dict(base, SWAP_AB=False, BLOCK_N=64, BLOCK_K=128)  # the A @ W^T tile
    out = [base, a_wt, dict(a_wt, BLOCK_N=128)]
    if int8 and tokens <= INT8_MAX_TOKENS:
        out += [dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
                for bn, bk, w in itertools.product((32, 64, 128), (128, 256, 512), (4, 8))]  # fmt: skip
    return out + _swap_candidates(base, "mxfp4")


def _prefill_candidates(base: dict) -> list[dict]:
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


def _linear_candidates(m: int, base: dict) -> list[dict]:
    """tl.dot configs (the GEMV ones are swept in _tune_linear)."""
    from kernels.triton.fp8_linear import default_config

    dot = base if base.get("KERNEL") == "dot" else default_config(32, 1, 1, torch.device("cuda"))
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


def _tune(make, candidates: list[dict]) -> dict:
    """make(cfg) -> a callable to time; the fastest config wins."""
    best, best_ms = candidates[0], float("inf")
    for cfg in candidates:
        try:
            ms = median_ms(make(cfg), warmup_ms=5, rep_ms=30)
        except Exception as err:  # a config can exceed shared memory or registers
            print(f"  skip {cfg}: {type(err).__name__}")
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best


def print_table(copy_bps: float, rows: list[dict]) -> None:
    print(f"device-to-device copy: {copy_bps / 1e12:.2f} TB/s (read + write)")
    head = f"{'op':10} {'case':32} {'MB':>8} {'us':>9} {'GB/s':>7} {'copy%':>6} {'torch us':>9} {'x':>6}"
    print(head)
    print_rows(rows)


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['op']:10} {r['case']:32} {r['bytes'] / 1e6:8.1f} {r['ms'] * 1e3:9.1f} "
              f"{r['gb_s']:7.0f} {100 * r['copy_frac']:5.1f}% {r['torch_ms'] * 1e3:9.1f} "
              f"{r['speedup_vs_torch']:6.1f}")  # fmt: skip


def _selected(only: str, name: str) -> bool:
    """`only` empty, or one of its comma-separated parts is in the case name."""
    parts = [p.strip() for p in only.split(",") if p.strip()]
    return not parts or any(p in name for p in parts)


def run(
    tune: bool = False,
    tuned_dir: Path | None = None,
    only: str = "",
    tokens: tuple[int, ...] = (),
    linear: bool = True,
    tune_max_tokens: int = TUNE_MAX_TOKENS,
    linear_tokens: tuple[int, ...] = ENGINE_LINEAR_TOKENS,
    linear_native: bool = False,
    native_only: bool = False,
    int8: bool = False,
    linear_shapes: tuple[tuple[int, int], ...] = tuple(LINEAR_SHAPES),
) -> dict:
    """Run every case (or those whose name contains `only`; MoE token counts `tokens` instead
    of each case's own; no FP8 linear rows with linear=False, only native FP8 ones with
    native_only; the MXFP4 int8 kernels among the tuner's candidates with int8; the large
    FP8 linears at `linear_shapes`); returns the JSON payload.
    Tuned configs are merged into the committed tables before they are written."""
    if not torch.cuda.is_available():
        raise click.ClickException("bench kernels needs a CUDA GPU")
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_bps = copy_bandwidth(device)
    rows, tables = [], {"fused_moe": {}, "fp8_linear": {}}
    for case in MOE_CASES:
        if not _selected(only, case.name):
            continue
        r, t = bench_moe(case, copy_bps, device, tune, tokens, tune_max_tokens, int8)
        rows += r
        tables["fused_moe"].update(t)
    for n, k in linear_shapes if linear else ():
        if not _selected(only, f"linear {n}x{k}"):
            continue
        natives = (True,) if native_only else (False, True)
        r, t = bench_linear(n, k, copy_bps, device, tune, LINEAR_TOKENS, natives,
                            tune_max_tokens)  # fmt: skip
        rows += r
        tables["fp8_linear"].update(t)
    for n, k in ENGINE_LINEAR_SHAPES if linear else ():
        if not _selected(only, f"moonlight-linear-{n}x{k}"):
            continue
        natives = (True,) if native_only else (False, True) if linear_native else (False,)
        r, t = bench_linear(n, k, copy_bps, device, tune, linear_tokens, natives,
                            tune_max_tokens)  # fmt: skip
        rows += r
        tables["fp8_linear"].update(t)
    print_table(copy_bps, rows)
    if tune and tuned_dir is not None:
        from kernels.triton.configs import CONFIG_DIR, device_key

        tuned_dir.mkdir(parents=True, exist_ok=True)
        for op, table in tables.items():
            if not table:
                continue
            committed = CONFIG_DIR / f"{op}.json"
            merged = json.loads(committed.read_text()) if committed.exists() else {}
            merged.setdefault(device_key(device), {}).update(table)
            (tuned_dir / f"{op}.json").write_text(json.dumps(merged, indent=1) + "\n")
    return {"copy_tb_s": copy_bps / 1e12, "tuned": tune, "results": rows}


@click.command("kernels")
@click.option("--tune", is_flag=True, help="Sweep launch configs per case and keep the best.")
@click.option("--tuned-dir", type=click.Path(path_type=Path), default=None,
              help="Where --tune writes fused_moe.json / fp8_linear.json.")  # fmt: skip
@click.option("--only", default="",
              help="Run only cases whose name contains this (comma: any of several).")  # fmt: skip
@click.option("--tokens", default="", help="MoE token counts, e.g. 1,8,64 (default: per case).")
@click.option("--no-linear", is_flag=True, help="Skip the FP8 linear rows.")
@click.option("--name", default="kernels-h200", show_default=True, help="JSON file name.")
@click.option("--tune-max-tokens", type=int, default=TUNE_MAX_TOKENS, show_default=True,
              help="MoE token counts up to which --tune sweeps configs.")  # fmt: skip
@click.option("--linear-tokens", default="",
              help="Token counts of the engine's FP8 linear rows (default: 1,2,4,8,64).")  # fmt: skip
@click.option("--linear-native", is_flag=True,
              help="Engine linear rows with native FP8 too (EngineConfig.fp8_native_min_tokens).")  # fmt: skip
@click.option("--native-only", is_flag=True,
              help="FP8 linear rows with native FP8 only (the decode path's are skipped).")  # fmt: skip
@click.option("--int8", is_flag=True,
              help="Let --tune weigh the MXFP4 int8 kernels (int8 activations, up to 8 tokens).")  # fmt: skip
@click.option("--linear-paths", is_flag=True,
              help="Only time the FP8 linear's GEMV, dot and native paths at decode sizes.")  # fmt: skip
@click.option("--linear-shapes", default="",
              help="Large FP8 linear shapes NxK, comma-separated (default: the DeepSeek-V3 "
                   "ones), e.g. 36864x7168 to see how a launch's fixed cost scales.")  # fmt: skip
def command(
    tune: bool,
    tuned_dir: Path | None,
    only: str,
    tokens: str,
    no_linear: bool,
    name: str,
    tune_max_tokens: int,
    linear_tokens: str,
    linear_native: bool,
    native_only: bool,
    int8: bool,
    linear_paths: bool,
    linear_shapes: str,
) -> None:
    """Fused MoE and FP8 linear: GB/s and % of copy bandwidth, vs plain torch."""
    if linear_paths:
        if not torch.cuda.is_available():
            raise click.ClickException("bench kernels needs a CUDA GPU")
        device = torch.device("cuda")
        payload = {"copy_tb_s": copy_bandwidth(device) / 1e12, "unit": "us per call",
                   "results": time_linear_paths(device)}  # fmt: skip
        click.echo(f"wrote {write_result(name, payload)}")
        return
    counts = tuple(int(v) for v in tokens.split(",") if v.strip())
    linear_counts = tuple(int(v) for v in linear_tokens.split(",") if v.strip())
    try:
        shapes = tuple(tuple(int(d) for d in v.lower().split("x")) for v in linear_shapes.split(",")
                       if v.strip())  # fmt: skip
    except ValueError as err:
        raise click.BadParameter(f"{linear_shapes!r}: expected NxK,... ({err})") from err
    if any(len(shape) != 2 for shape in shapes):
        raise click.BadParameter(f"{linear_shapes!r}: expected NxK,...")
    payload = run(tune=tune, tuned_dir=tuned_dir, only=only, tokens=counts,
                  linear=not no_linear, tune_max_tokens=tune_max_tokens,
                  linear_tokens=linear_counts or ENGINE_LINEAR_TOKENS,
                  linear_native=linear_native, native_only=native_only, int8=int8,
                  linear_shapes=shapes or tuple(LINEAR_SHAPES))  # fmt: skip
    path = write_result(name, payload)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    command()
