"""`batchgen bench kernels`: the fused MoE and FP8 linear kernels at decode shapes, in GB/s
and as a fraction of the device-to-device copy bandwidth measured in the same run, next to
a plain torch implementation of the same op (experts looped and dequantized in bf16; the
FP8 weight dequantized to bf16, then F.linear).

Bytes counted per call: the weights the call touches (each distinct expert's codes and
scales once), the activations read and the output written. Routings rotate among several
random draws so the touched experts change between calls and the L2 (50 MB) does not
serve them. `--tune` runs the tuner (kernels/tune/) on each case, times its choice, and
writes the tables kernels/triton/configs/*.json are made of (configs.write_entries).

Runs on a CUDA GPU; also `python -m batchgen.bench.kernels` (imports torch, triton, click).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import click
import torch
import torch.nn.functional as F

from batchgen.bench.common import write_result
from kernels.tune.timing import copy_bandwidth, cycle, median_ms, time_chain, time_graphed

ROUTINGS = 8
# --tune sweeps only decode shapes (the bandwidth goals); larger ones keep the heuristic.
TUNE_MAX_TOKENS = 8


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
    from kernels.triton.fused_moe import choose_config, fused_moe, shape_key
    from kernels.tune import fused_moe as tune_fused_moe

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
            cfg = tune_fused_moe.tune(x, weights, routings, case.fmt, int8)
            tuned[shape_key(t, case.top_k, case.e, case.d, case.i, case.fmt)] = cfg
        else:
            cfg = choose_config(t, case.top_k, case.e, case.d, case.i, case.fmt, device)
        calls = _moe_calls(fused_moe, x, weights, routings, fmt=case.fmt, config=cfg)
        ms = time_graphed(calls)
        eager_ms = median_ms(cycle(calls))
        # The loop over experts reads routing counts back to the host: eager only.
        ref = _moe_calls(fused_moe_reference, x, weights, routings, fmt=case.fmt,
                         compute_dtype=torch.bfloat16)  # fmt: skip
        ref_ms = median_ms(cycle(ref))
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
    from kernels.triton.fp8_linear import choose_config, shape_key
    from kernels.tune import fp8_linear as tune_fp8_linear
    from kernels.tune.fp8_linear import chain_ms

    q, s = random_fp8_block((n, k), device=device)
    per_copy = n * k + s.numel() * 4
    copies = max(2, min(LINEAR_CHAIN_MAX, math.ceil(LINEAR_CHAIN_BYTES / per_copy)))
    weights = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
    rows, tuned = [], {}
    for m in tokens:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        nbytes = per_copy + m * k * 2 + m * n * 2
        for native in natives:
            # Untuned: what the engine launches (the committed table, else the heuristic).
            cfg = choose_config(m, n, k, device, native)
            if tune and m <= tune_max_tokens:
                cfg = tune_fp8_linear.tune(x, weights, native)
                tuned[shape_key(m, n, k, native)] = cfg
            ms = chain_ms(x, weights, native, cfg)
            # The same dequantize + F.linear a plain torch layer does, graph-captured too.
            ref_ms = time_chain(
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
    from kernels.tune.fp8_linear import chain_ms

    rows = []
    for n, k in ENGINE_LINEAR_SHAPES + LINEAR_SHAPES[:1]:
        q, s = random_fp8_block((n, k), device=device)
        copies = max(2, min(LINEAR_CHAIN_MAX, math.ceil(LINEAR_CHAIN_BYTES / (n * k))))
        weights = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
        for m in (1, 2, 8):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            dot = default_config(16, n, k, device)  # the dot kernel's small-M config
            row = {"n": n, "k": k, "m": m}
            row["gemv_us"] = 1e3 * chain_ms(x, weights, False, default_gemv_config(m, n, k, device))
            row["dot_us"] = 1e3 * chain_ms(x, weights, False, dot)
            row["native_us"] = 1e3 * chain_ms(
                x, weights, True, default_config(m, n, k, device, True)
            )
            rows.append(row)
            print(
                f"fp8 linear paths {n}x{k} M={m}: gemv {row['gemv_us']:.1f} us, "
                f"dot {row['dot_us']:.1f} us, native {row['native_us']:.1f} us"
            )
    return rows


def _row(op, case, nbytes, ms, ref_ms, copy_bps, cfg) -> dict:
    gbs = nbytes / (ms * 1e-3) / 1e9
    return dict(op=op, case=case, bytes=int(nbytes), ms=ms, gb_s=gbs,
                copy_frac=gbs * 1e9 / copy_bps, floor_ms=nbytes / copy_bps * 1e3,
                torch_ms=ref_ms, speedup_vs_torch=ref_ms / ms, config=cfg)  # fmt: skip


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
        from kernels.triton.configs import device_key, write_entries

        for op, table in tables.items():
            if table:
                write_entries(op, device_key(device), table, tuned_dir)
    return {"copy_tb_s": copy_bps / 1e12, "tuned": tune, "results": rows}


def run_linear_paths() -> dict:
    """The payload of `--linear-paths`: time_linear_paths on this GPU, us per call."""
    if not torch.cuda.is_available():
        raise click.ClickException("bench kernels needs a CUDA GPU")
    device = torch.device("cuda")
    return {"copy_tb_s": copy_bandwidth(device) / 1e12, "unit": "us per call",
            "results": time_linear_paths(device)}  # fmt: skip


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """`NxK,NxK` -> ((N, K), ...); empty text -> ()."""
    try:
        shapes = tuple(tuple(int(d) for d in v.lower().split("x")) for v in text.split(",")
                       if v.strip())  # fmt: skip
    except ValueError as err:
        raise click.BadParameter(f"{text!r}: expected NxK,... ({err})") from err
    if any(len(shape) != 2 for shape in shapes):
        raise click.BadParameter(f"{text!r}: expected NxK,...")
    return shapes


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
        click.echo(f"wrote {write_result(name, run_linear_paths())}")
        return
    counts = tuple(int(v) for v in tokens.split(",") if v.strip())
    linear_counts = tuple(int(v) for v in linear_tokens.split(",") if v.strip())
    shapes = parse_shapes(linear_shapes)
    payload = run(tune=tune, tuned_dir=tuned_dir, only=only, tokens=counts,
                  linear=not no_linear, tune_max_tokens=tune_max_tokens,
                  linear_tokens=linear_counts or ENGINE_LINEAR_TOKENS,
                  linear_native=linear_native, native_only=native_only, int8=int8,
                  linear_shapes=shapes or tuple(LINEAR_SHAPES))  # fmt: skip
    path = write_result(name, payload)
    click.echo(f"wrote {path}")


if __name__ == "__main__":
    command()
