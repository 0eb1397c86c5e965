"""How far a row's tokens depend on its batch on a CUDA GPU (docs/batch-invariance.md).

Seeded sampled target rows (temperature 1.0) run alone, then among neighbours of every
kind (min_tokens bans that force eager steps, other lengths and parameters) at batch 64;
prints and writes (JSON, to $OUT or /tmp/gpu_out) how many targets' tokens differ and at
which output position the first difference is, per model, with batch_invariant on and off.

    python3 scripts/gpu_batch_invariance.py [--layers 2]
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

from engine import LLM, Request, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint

TARGETS = 8
NEW = 64


def _rows(vocab: int, neighbours: int):
    targets = [
        ([(11 * t + 5 * j) % (vocab - 300) + 256 for j in range(16 + 9 * t)],
         SamplingParams(temperature=1.0, max_tokens=NEW, seed=1000 + t, ignore_eos=True))
        for t in range(TARGETS)
    ]  # fmt: skip
    others = []
    for i in range(neighbours):
        prompt = [(7 * i + j) % (vocab - 300) + 256 for j in range(4 + (13 * i) % 120)]
        if i % 4 == 0:
            p = SamplingParams(temperature=1.0, min_tokens=8, max_tokens=NEW, seed=i)
        elif i % 4 == 1:
            p = SamplingParams(temperature=0.0, max_tokens=5 + i % 40, ignore_eos=True)
        else:
            p = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW, seed=i, ignore_eos=True)
        others.append((prompt, p))
    return targets, others


def _run(llm: LLM, targets, others) -> list[list[int]]:
    reqs = [Request(f"n{i}", p, sp) for i, (p, sp) in enumerate(others)]
    for t, (p, sp) in enumerate(targets):
        reqs.insert((t * 5) % (len(reqs) + 1), Request(f"t{t}", p, sp))
    outs = {o.request_id: o for o in llm.stream(reqs)}
    return [outs[f"t{t}"].outputs[0].token_ids for t in range(len(targets))]


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def measure(path: Path, dtype: str, batch: int, batch_invariant: bool) -> dict:
    llm = LLM(str(path), dtype=dtype, max_num_seqs=batch, batch_invariant=batch_invariant)
    vocab = int(llm.engine.runner.source.config["vocab_size"])
    targets, others = _rows(vocab, batch - TARGETS)
    alone = [_run(llm, [t], [])[0] for t in targets]
    start = time.time()
    mixed = _run(llm, targets, others)
    firsts = [_first_difference(a, m) for a, m in zip(alone, mixed)]
    del llm
    gc.collect()  # the engine's graphs and KV cache go before the next one sizes its cache
    torch.cuda.empty_cache()
    return {
        "dtype": dtype,
        "batch_invariant": batch_invariant,
        "batch": batch,
        "targets": TARGETS,
        "new_tokens": NEW,
        "targets_differing": sum(f is not None for f in firsts),
        "first_difference_at": firsts,
        "mixed_run_s": round(time.time() - start, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    out = Path(os.environ.get("OUT", "/tmp/gpu_out"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as root:
        tiny = make_random_checkpoint(Path(root) / "tiny", preset="tiny", seed=3, mtp=False)
        models = [("tiny", tiny, "float32")]
        for dense, experts in (("fp8", "mxfp4"), ("bf16", "bf16")):
            path = make_random_checkpoint(
                Path(root) / f"moon-{experts}", preset="moonlight-16b-a3b", layers=args.layers,
                seed=3, mtp=False, dense_dtype=dense, expert_dtype=experts,
            )  # fmt: skip
            name = f"moonlight-{args.layers}layers-{dense}-{experts}".replace("bf16-bf16", "bf16")
            models.append((name, path, "bfloat16"))
        for name, path, dtype in models:
            for invariant in (True, False):
                results.append({"model": name, **measure(path, dtype, 64, invariant)})
                print(results[-1], flush=True)
    (out / "gpu-batch-invariance.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
