"""A few decode steps of a random Moonlight-shaped model, for Nsight Compute on the GPU
machine. A command that works there (ncu 2025.3, ~1 minute):

  ncu --clock-control none --target-processes all \
      -k regex:"mla_decode_kernel|fp8_gemv_kernel|moe_prologue_kernel|int8_kernel|rmsnorm_kernel" \
      --launch-skip 70 --launch-count 40 --section SpeedOfLight --section LaunchStats \
      --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 scripts/ncu_decode_step.py --weights fp8-mxfp4 --layers 3 --batch 1 --steps 3

The kernel filter and skip count pass over the warm-up (the skip counts only launches the
filter matches: a filter on fewer kernels, e.g. "int8_kernel", needs a smaller skip, or
it skips every launch of a 3-layer model); the replayed graphs' kernels are profiled one
node at a time. The measured steps also sit between cudaProfilerStart/Stop for
`--profile-from-start off`, but with it ncu profiles from the engine's load on (not
understood). The KV cache is kept at 1 GiB: ncu saves and restores the device memory
around each replay pass, and with the engine's default cache, which fills the free
memory, the run fails after one kernel. Without ncu the script prints the decode step
time, so the same script checks itself.
"""

from __future__ import annotations

import time
from pathlib import Path

import click
import torch

from batchgen.bench.decode_moe import make_checkpoint, random_prompts


@click.command()
@click.option("--weights", default="fp8-mxfp4")
@click.option("--layers", default=3, type=int, help="Layer 0 is dense in Moonlight.")
@click.option("--batch", default=1, type=int)
@click.option("--steps", default=2, type=int, help="Decode steps inside the profiled range.")
@click.option("--prompt-len", default=128, type=int)
@click.option("--workdir", default="/tmp/batchgen-ncu", type=click.Path(path_type=Path))
def main(weights: str, layers: int, batch: int, steps: int, prompt_len: int, workdir: Path):
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    path = make_checkpoint(workdir, "moonlight-16b-a3b", layers, weights)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=batch,
              max_num_batched_tokens=4096, max_model_len=prompt_len + 64,
              kv_cache_memory=1 << 30)  # fmt: skip
    engine = llm.engine
    vocab = int(engine.runner.model.config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=1)):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(4):  # prefill, then decode steps that warm the graph replay
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    ms = 1e3 * (time.perf_counter() - t0) / steps
    print(f"{steps} decode steps at batch {batch}: {ms:.3f} ms each")
    while engine.has_unfinished():
        engine.step()


if __name__ == "__main__":
    main()
