"""One GPU call's check of the DeepSeek-V4 family on CUDA: a tiny random V4 checkpoint
(every feature on) through engine.LLM on the GPU against the CPU float32 run (which
tests/engine/test_v4_parity.py ties to transformers), with decode graphs and eagerly.

    PYTHONPATH=. python3 scripts/gpu_v4_check.py [out.json]

Reports per configuration: whether decode steps replayed CUDA graphs, the greedy tokens'
agreement with the CPU float32 run (first differing position per prompt), and tok/s.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 9], [256] + list(range(30, 70))]
NEW = 48


def greedy(llm: LLM) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    return outs, len(PROMPTS) * NEW / (time.perf_counter() - start)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def main() -> None:
    out_path = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    root = Path(tempfile.mkdtemp())
    results = {"device": torch.cuda.get_device_name(), "runs": []}
    for fmt in ("bf16", "fp8-mxfp4"):
        dense, experts = ("bf16", "bf16") if fmt == "bf16" else ("fp8", "mxfp4")
        path = make_random_checkpoint(
            root / fmt, arch="deepseek_v4", preset="tiny", seed=3, dense_dtype=dense,
            expert_dtype=experts, mtp=False, device="cuda",
        )  # fmt: skip
        want, _ = greedy(LLM(str(path), device="cpu", dtype="float32"))
        for dtype in ("float32", "bfloat16"):
            for eager in (False, True):
                run = {"format": fmt, "dtype": dtype, "eager": eager}
                try:
                    llm = LLM(str(path), device="cuda", dtype=dtype, record_routing=eager)
                    got, tok_s = greedy(llm)
                    run["graphs"] = llm.engine.runner.graphs is not None and not eager
                    run["first_difference"] = [first_difference(g, w) for g, w in zip(got, want)]
                    run["tok_s"] = round(tok_s, 1)
                    del llm
                except Exception as exc:  # report and go on: one call checks every case
                    run["error"] = f"{type(exc).__name__}: {exc}"[:300]
                results["runs"].append(run)
                print(json.dumps(run), flush=True)
                torch.cuda.empty_cache()
    if out_path:
        out_path.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
