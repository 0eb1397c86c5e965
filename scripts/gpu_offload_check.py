"""Expert offload on the GPU machine (issue 24): correctness of the split against all-GPU
on a tiny model, then decode speed of V4-Flash (or Moonlight) layers with a share of their
experts on the host against all on the GPU, the host experts computed by the CPU or
(`--computes cpu,pcie`) copied to the GPU when used. FP8 + MXFP4 weights drawn in memory.
Writes offload-<name>.json to $BATCHGEN_BENCH_DIR.

    python scripts/gpu_offload_check.py [--preset v4-flash|moonlight-16b-a3b] [--layers 4]
        [--batches 1,8,64] [--shares 0,0.125,0.5] [--computes cpu,pcie]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint
from engine.expert_placement import ExpertPlacement
from engine.layers.moe import DeepseekMoE

PROMPTS = [[3, 17, 42, 5, 9, 11, 60, 2], [7, 70, 77], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]


def moe_layers(llm):
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, DeepseekMoE)]


def every_nth_on_host(layers: list[int], num_experts: int, share: float, path: Path) -> Path:
    """Host experts: an evenly spread `share` of each layer's experts."""
    n = round(num_experts * share)
    spread = tuple(sorted({int(i * num_experts / n) for i in range(n)})) if n else ()
    ExpertPlacement(dict.fromkeys(layers, spread)).save(path)
    return path


def correctness(work: Path, dtypes) -> dict:
    ckpt = make_random_checkpoint(work / "tiny", arch="deepseek_v4", preset="tiny",
                                  dense_dtype="fp8", expert_dtype="mxfp4", device="cpu",
                                  mtp=False)  # fmt: skip
    out = {}
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for dtype in dtypes:
        full = LLM(str(ckpt), device="cuda", dtype=dtype)
        moes = moe_layers(full)
        layers = [m.layer_index for m in moes]
        placement = every_nth_on_host(layers, moes[0].experts.num_experts, 0.5, work / "h.json")
        split = LLM(str(ckpt), device="cuda", dtype=dtype, expert_offload=str(placement))
        a = [o.outputs[0].token_ids for o in full.generate(PROMPTS, greedy)]
        b = [o.outputs[0].token_ids for o in split.generate(PROMPTS, greedy)]
        same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
        total = sum(len(r) for r in a)
        x = torch.randn(5, moe_layers(full)[0].experts.gate_proj.in_features, device="cuda")
        x = x.to(getattr(torch, dtype))
        errors = []
        with torch.inference_mode():
            pairs = list(zip(moe_layers(full), moe_layers(split)))
        for ma, mb in pairs:
            ids = torch.arange(5, device="cuda") if ma.gate.tid2eid is not None else None
            with torch.inference_mode():
                ya, yb = ma(x, ids).float(), mb(x, ids).float()
            errors.append(float((ya - yb).norm() / ya.norm()))
        out[dtype] = {"greedy_equal": a == b, "tokens_equal": f"{same}/{total}",
                      "moe_layer_rel_err": errors,
                      "split_cuda_graphs": split.engine.runner.graphs is not None}  # fmt: skip
        print(dtype, out[dtype], flush=True)
        del full, split, moes
        gc.collect()
        torch.cuda.empty_cache()
    return out


MODELS = {"v4-flash": "deepseek_v4", "moonlight-16b-a3b": "deepseek_v3"}


def decode_speed(work: Path, preset: str, layers, batches, shares, computes,
                 new_tokens: int) -> list[dict]:  # fmt: skip
    from batchgen.bench import offload_figures as offload
    from batchgen.bench.decode_moe import random_model
    from engine.loader.random_source import parse_random_spec

    arch = MODELS[preset]
    path = random_model(arch, preset, layers, "fp8-mxfp4")  # drawn on the GPU
    config = parse_random_spec(path).checkpoint.config()
    first_moe = config.get("first_k_dense_replace", 0)
    moe = list(range(first_moe, config["num_hidden_layers"]))
    rows = []
    for share in shares:
        for compute in computes if share else ("cpu",):
            options = {"expert_offload_compute": compute}
            if share == "auto":
                options["expert_offload"] = "auto"
            elif share:
                placement = work / f"placement-{share}.json"
                every_nth_on_host(moe, config["n_routed_experts"], share, placement)
                options["expert_offload"] = str(placement)
            t0 = time.perf_counter()
            llm = LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                      max_num_batched_tokens=16384, max_model_len=128 + new_tokens + 16,
                      batch_invariant=False, kv_cache_memory=8 << 30, **options)  # fmt: skip
            load_s = time.perf_counter() - t0
            rows += _measure(llm, offload, share, compute, batches, new_tokens, load_s)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def _measure(llm, offload, share, compute, batches, new_tokens, load_s) -> list[dict]:
    vocab = llm.engine.runner.model.config.vocab_size
    rows = []
    for batch in batches:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, vocab, (128,), generator=gen).tolist() for _ in range(batch)]
        timings = {}
        for n in (1, new_tokens):
            params = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                      for i in range(batch)]  # fmt: skip
            llm.generate(prompts, params)  # warm
            offload.reset(llm)
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompts, params)
            torch.cuda.synchronize()
            timings[n] = time.perf_counter() - t
        step_s = (timings[new_tokens] - timings[1]) / (new_tokens - 1)
        row = {"host_share": share, "compute": compute, "batch": batch, "load_s": round(load_s, 1),
               "decode_tok_s": round(batch / step_s, 1), "step_ms": round(step_s * 1e3, 3),
               "cuda_graphs": llm.engine.runner.graphs is not None}  # fmt: skip
        host = offload.host_step(llm, batch)  # the last generate's decode steps
        if host is not None:
            row |= {"host": host, "placement": llm.expert_placement | {"layers": None}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(MODELS), default="v4-flash")
    ap.add_argument("--layers", type=int, default=4, help="0: all")
    ap.add_argument("--computes", default="cpu", help="cpu, pcie or both (comma-separated)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--shares", default="0,0.125,0.5", help="host shares, or auto")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--skip-correctness", action="store_true")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--name", default="h200-v4flash")
    a = ap.parse_args()
    out_dir = Path(os.environ.get("BATCHGEN_BENCH_DIR", "data/benchmarks"))
    result = {"machine": torch.cuda.get_device_name(), "cpu_cores": os.cpu_count(),
              "command": "python scripts/gpu_offload_check.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                  if not isinstance(v, bool))}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if not a.skip_correctness:
            result["correctness"] = correctness(work, a.dtypes.split(","))
        batches = [int(b) for b in a.batches.split(",")]
        shares = [s if s == "auto" else float(s) for s in a.shares.split(",")]
        result["decode"] = decode_speed(work, a.preset, a.layers or None, batches, shares,
                                        a.computes.split(","), a.new_tokens)  # fmt: skip
    (out_dir / f"offload-{a.name}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
