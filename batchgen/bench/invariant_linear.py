"""`batchgen bench invariant-linear`: tune the batch-invariant linears of a DeepSeek-V3
preset on this GPU (kernels/tune/invariant_linear.py): per weight shape one launch config
for every row count, the plain matmul (bf16 weights, the lm_head, the float32 router) and
the FP8 block-scaled dot kernel (FP8 checkpoints' dense weights); then each shape's tiles
at a few small row counts, its BLOCK_K and K split held (`--tiles-only` keeps those from the
committed table, so no row's bits change).

Writes the table to `--tuned-dir`/fixed_linear.json (copy it into kernels/triton/configs/
to keep it) and the times (us per call at each row count: the kept config, the heuristic it
replaces, the fastest candidate at that row count alone, torch's F.linear) to
data/benchmarks/<name>.json. Runs on a CUDA GPU, also as `python -m
batchgen.bench.invariant_linear` (imports torch, triton, click).
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import torch

from batchgen.bench.common import write_result


def linear_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a DeepSeek-V3 config's dense linears (q_lora_rank None)."""
    d, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    shared = cfg["n_shared_experts"] * cfg["moe_intermediate_size"]
    return {
        "q_proj": (heads * qk, d),
        "kv_a_proj": (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], d),
        "o_proj": (d, heads * cfg["v_head_dim"]),
        "shared_gate_up": (2 * shared, d),
        "shared_down": (d, shared),
        "dense_gate_up": (2 * cfg["intermediate_size"], d),
        "dense_down": (d, cfg["intermediate_size"]),
        "lm_head": (cfg["vocab_size"], d),
        "router": (cfg["n_routed_experts"], d),
    }


@click.command("invariant-linear")
@click.option("--preset", default="moonlight-16b-a3b", show_default=True)
@click.option("--rows", default="1,8,64,256,1024", show_default=True)
@click.option(
    "--tile-rows",
    default="1,8,32,128",
    show_default=True,
    help="Row counts whose tiles are tuned with the shape's BLOCK_K and K split held.",
)
@click.option(
    "--tiles-only",
    is_flag=True,
    help="Keep each shape's BLOCK_K and K split from the committed table (a row's "
    "bits stay what they are) and tune only the row-count tiles.",
)
@click.option("--only", default="", help="Comma-separated shape names (default: all).")
@click.option("--no-fp8", is_flag=True, help="Tune only the plain matmul.")
@click.option("--tuned-dir", type=click.Path(path_type=Path), default=Path("tuned"),
              show_default=True)  # fmt: skip
@click.option("--name", default="invariant-linear-h200-moonlight", show_default=True)
def command(preset, rows, tile_rows, tiles_only, only, no_fp8, tuned_dir, name):
    from engine.checkpoint_maker import PRESETS
    from kernels.triton import configs, fp8_linear, matmul
    from kernels.tune import invariant_linear as tune

    if not torch.cuda.is_available():
        raise click.UsageError("bench invariant-linear needs a CUDA GPU")
    device = torch.device("cuda")
    counts = tuple(int(r) for r in rows.split(","))
    tiles_at = tuple(int(r) for r in tile_rows.split(",")) if tile_rows else ()
    shapes = linear_shapes(PRESETS[preset])
    if only:
        shapes = {k: v for k, v in shapes.items() if k in only.split(",")}
    entries, results = {}, []
    start = time.perf_counter()
    for label, (n, k) in shapes.items():
        # FP8 checkpoints keep the lm_head and the router in plain weights
        kinds = [("bf16", torch.bfloat16)]
        if label == "router":
            kinds = [("f32", torch.float32)]
        elif not no_fp8 and label != "lm_head":
            kinds.append(("fp8", None))
        for kind, dtype in kinds:
            t0 = time.perf_counter()
            if kind == "fp8":
                keep = fp8_linear.fixed_config(n, k, device) if tiles_only else None
                r = tune.tune_fp8(n, k, device, counts, tiles_at, keep)
                entries[f"fp8_N{n}_K{k}"] = r["config"]
            else:
                keep = matmul.fixed_config(n, k, dtype, device) if tiles_only else None
                r = tune.tune_matmul(n, k, dtype, device, counts, tiles_at, keep)
                entries[matmul.shape_key(n, k, dtype)] = r["config"]
            row = {"shape": label, "kind": kind, "n": n, "k": k, **r,
                   "tune_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
            results.append(row)
            print(f"{label} {kind} {n}x{k}: {r['config']} cost {r.get('relative_cost')} "
                  f"us {r.get('us')} heuristic {r.get('heuristic_us')} torch "
                  f"{r.get('torch_us')} tiles {r['tiles_us']}", flush=True)  # fmt: skip
            # after each shape, so a cut-off run keeps what it tuned
            path = configs.write_entries(matmul.TABLE, configs.device_key(device), entries,
                                         tuned_dir)  # fmt: skip
            write_result(name, {"preset": preset, "rows": list(counts), "results": results})
    payload = {"preset": preset, "rows": list(counts), "tile_rows": list(tiles_at),
               "tiles_only": tiles_only, "results": results,
               "tune_s": round(time.perf_counter() - start, 1), "table": str(path)}  # fmt: skip
    print(f"wrote {write_result(name, payload)} and {path}")


if __name__ == "__main__":
    command()
