"""`batchgen bench step-tune`: choose the decode step's fused-MoE table entries by timing the
whole step's CUDA graph, not each kernel alone (kernels/tune/step.py says why and holds the
candidates and the descent; this module builds the engine and times its step).

Entries per bucket: the routed experts' (`T{b}_A{k}_E{e}_...`) and the shared expert's
(`T{b}_A1_E1_...`), at the model's shapes. Writes data/benchmarks/<name>.json (every
candidate's step time) and, with --tuned-dir, the fused_moe table merged into the committed
one (copy it to kernels/triton/configs/ to keep it).

Run on the GPU machine as `python -m batchgen.bench.step_tune`.
"""

from __future__ import annotations

import gc
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import torch

from batchgen.bench.common import write_result
from batchgen.bench.decode_moe import WEIGHTS, log, make_checkpoint, random_prompts
from kernels.triton import configs

if TYPE_CHECKING:
    from kernels.tune.step import MoeEntry

OP = "fused_moe"


def moe_entries(model) -> list[MoeEntry]:
    """The routed and shared entries of the model's MoE layers (all layers share shapes)."""
    from engine.backends.cuda.moe import CudaMoeOps
    from engine.layers.moe import DeepseekMoE
    from kernels.tune.step import MoeEntry

    for module in model.modules():
        if not isinstance(module, DeepseekMoE) or not isinstance(module.ops, CudaMoeOps):
            continue
        out = []
        fused = module.ops.fused
        if fused is not None:
            half = 2 if fused.fmt == "mxfp4" else 1
            e, d, i = fused.w2.shape[0], fused.w2.shape[1], fused.w2.shape[-1] * half
            out.append(MoeEntry("routed", int(model.config.num_experts_per_tok), e, d, i,
                                fused.fmt))  # fmt: skip
        shared = module.ops.shared
        if shared is not None:
            half = 2 if shared.fmt == "mxfp4" else 1
            out.append(MoeEntry("shared", 1, 1, shared.w2.shape[0],
                                shared.w2.shape[-1] * half, shared.fmt))  # fmt: skip
        return out
    return []


class StepTimer:
    """Times one bucket's decode graph on real decode rows, captured again with the launch
    configs as they are stored now (configs.store)."""

    def __init__(self, llm, seqs: list, reps: int = 20) -> None:
        self.runner = llm.engine.runner
        self.seqs, self.reps = seqs, reps

    def ms(self, bucket: int) -> float:
        """ms per replay of `bucket`'s graph; inf when a config does not compile, launch or
        validate."""
        graphs = self.runner.graphs
        try:
            graphs.recapture([bucket])
        except Exception as err:  # a tile can exceed registers or shared memory
            log(f"  skip: {type(err).__name__}: {str(err)[:120]}")
            return float("inf")
        graphs.inputs.fill(self.seqs[:bucket], bucket)
        graph = graphs.graphs[bucket]
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / self.reps


def tune_bucket(timer: StepTimer, entries: list[MoeEntry], bucket: int) -> tuple[dict, list]:
    """kernels.tune.step's descent at one bucket; the shared expert's entry only where the
    fused MoE runs it (SHARED_FUSED_MAX_TOKENS)."""
    from engine.backends.cuda.moe import SHARED_FUSED_MAX_TOKENS
    from kernels.tune.step import tune_entries

    entries = [e for e in entries if e.role != "shared" or bucket <= SHARED_FUSED_MAX_TOKENS]
    return tune_entries(entries, bucket, timer.runner.device, lambda: timer.ms(bucket), log)


def decode_rows(llm, batch: int, prompt_len: int, vocab: int) -> list:
    """`batch` sequences past their prefill and a few decode steps: real decode rows (their
    own context lengths and experts) for the graphs to replay."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=21)):
        engine.add_request(f"tune-{i}", prompt, params)
    while engine.scheduler.waiting or any(
        s.num_computed < len(s) - 1 for s in engine.scheduler.running
    ):
        engine.step()
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    running = list(engine.scheduler.running)
    for seq in running:  # the slot of the token a replay computes (a step grows it first)
        engine.scheduler.blocks.grow(seq, len(seq))
    return running


def tune_weights(path: Path, weights: str, batches: tuple[int, ...], prompt_len: int) -> dict:
    from engine.cuda_graph_runner import capture_buckets
    from engine.llm import LLM

    buckets = capture_buckets(max(batches))
    if not set(batches) <= set(buckets):  # a timing would fail for every candidate
        raise click.BadParameter(f"batches must be decode graph buckets {buckets}, got {batches}")

    # async scheduling off: a step's tokens are read before it returns, so no row is left
    # pending for the graph inputs filled here
    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
              max_num_batched_tokens=16384, max_model_len=prompt_len + 96,
              async_scheduling=False)  # fmt: skip
    model = llm.engine.runner.model
    entries = moe_entries(model)
    seqs = decode_rows(llm, max(batches), prompt_len, int(model.config.vocab_size))
    timer = StepTimer(llm, seqs)
    tuned, rows = {}, []
    try:
        for bucket in batches:
            t, r = tune_bucket(timer, entries, bucket)
            tuned.update(t)
            rows += [dict(row, weights=weights) for row in r]
    finally:
        configs.clear_stored(OP)
        del timer, seqs, model, llm
        gc.collect()
        torch.cuda.empty_cache()
    return {"tuned": tuned, "rows": rows}


def run(
    preset: str,
    layers: int | None,
    weights: list[str],
    buckets: tuple[int, ...],
    prompt_len: int,
    workdir: Path,
    name: str,
    tuned_dir: Path | None = None,
) -> dict:
    """Tune each weight format's entries at `buckets` on a random `preset` checkpoint;
    writes data/benchmarks/<name>.json after each format (a cut-off run keeps its rows)
    and, with `tuned_dir`, the merged fused_moe table. Returns the payload."""
    if not torch.cuda.is_available():
        raise click.UsageError("bench step-tune needs a CUDA GPU")
    unknown = [w for w in weights if w not in WEIGHTS]
    if unknown:
        raise click.BadParameter(f"unknown weights {unknown}; choose from {sorted(WEIGHTS)}")
    payload: dict = {"preset": preset, "layers": layers, "prompt_tokens": prompt_len,
                     "results": [], "tuned": {}}  # fmt: skip
    for w in weights:
        t0 = time.perf_counter()
        path = make_checkpoint(workdir, preset, layers, w)
        out = tune_weights(path, w, buckets, prompt_len)
        shutil.rmtree(path, ignore_errors=True)
        payload["results"] += out["rows"]
        payload["tuned"].update(out["tuned"])
        log(f"{w}: tuned in {time.perf_counter() - t0:.0f} s")
        write_result(name, payload)
    if tuned_dir is not None:
        device = configs.device_key(torch.device("cuda"))
        log(f"wrote {configs.write_entries(OP, device, payload['tuned'], tuned_dir)}")
    log(f"wrote {write_result(name, payload)}")
    return payload


@click.command("step-tune")
@click.option("--preset", default="moonlight-16b-a3b", show_default=True)
@click.option("--layers", type=int, default=None, help="Fewer layers at real shapes.")
@click.option("--weights", default="bf16,fp8-mxfp4", show_default=True,
              help=f"Comma-separated, of {sorted(WEIGHTS)}.")  # fmt: skip
@click.option("--batches", default="1,8", show_default=True, help="Decode buckets to tune.")
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--workdir", type=click.Path(path_type=Path), default=Path("/tmp/batchgen-bench"),
              show_default=True)  # fmt: skip
@click.option("--tuned-dir", type=click.Path(path_type=Path), default=None,
              help="Write the merged fused_moe table here.")  # fmt: skip
@click.option("--name", default="step-tune-h200-moonlight", show_default=True)
def command(preset, layers, weights, batches, prompt_len, workdir, tuned_dir, name):
    """Tune the decode step's fused-MoE table entries inside the step's CUDA graph."""
    chosen = [w.strip() for w in weights.split(",") if w.strip()]
    buckets = tuple(int(b) for b in batches.split(",") if b.strip())
    run(preset, layers, chosen, buckets, prompt_len, workdir, name, tuned_dir)


if __name__ == "__main__":
    command()
