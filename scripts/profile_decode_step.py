"""Kernel time per decode step of a random Moonlight-shaped model, by kernel name, with batch
invariance on and off (torch profiler over graphed steps, temperature 1.0). A diagnostic for
the GPU machine, not a bench: docs/notes-vllm-peer.md quotes its output.

  PYTHONPATH=. python3 scripts/profile_decode_step.py --weights bf16 --batches 1,8,32
"""

from __future__ import annotations

import argparse
import collections
import gc
import time

import torch
from torch.profiler import ProfilerActivity, profile

from batchgen.bench.decode_moe import random_model, random_prompts
from engine.llm import LLM
from engine.sampling_params import SamplingParams


def profile_batch(engine, batch: int, steps: int, top: int) -> None:
    vocab = int(engine.runner.model.config.vocab_size)
    for i, prompt in enumerate(random_prompts(batch, 128, vocab, seed=batch)):
        params = SamplingParams(temperature=1.0, seed=i, max_tokens=3 * steps + 10, ignore_eos=True)
        engine.add_request(f"b{batch}r{i}", prompt, params)
    for _ in range(6):  # the prefill, then graph replays warmed up
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    by_name = collections.defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = by_name[event.name[:70]]
            entry[0] += event.device_time
            entry[1] += 1
    kernel_ms = sum(t for t, _ in by_name.values()) / steps / 1e3
    launches = sum(n for _, n in by_name.values()) / steps
    print(f"batch {batch}: wall {wall_ms:.3f} ms/step, kernels {kernel_ms:.3f} ms, "
          f"{launches:.0f} launches/step")  # fmt: skip
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {t / steps:9.1f} us  x{n / steps:6.1f}  {name}")
    while engine.has_unfinished():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="bf16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    for invariant in (True, False):
        print(f"== {args.weights}, batch_invariant={invariant}")
        llm = LLM(random_model("deepseek_v3", "moonlight-16b-a3b", None, args.weights),
                  device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
                  max_num_batched_tokens=4096, max_model_len=512, kv_cache_memory=4 << 30,
                  batch_invariant=invariant)  # fmt: skip
        for batch in batches:
            profile_batch(llm.engine, batch, args.steps, args.top)
        del llm
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
