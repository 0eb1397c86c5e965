"""`batchgen bench step-tune`: choose the decode step's fused-MoE table entries by timing the
whole step's CUDA graph, not each kernel alone.

Why: at a few tokens the shared expert's launches run on a side stream beside the routed
experts', and a tile tuned alone (`bench kernels --tune`) can be the worst one beside them.
H200, Moonlight shape, FP8 + MXFP4, batch 1: the shared expert's FP8 down took 21-25 us in
the step against 7.5 us alone with its tuned tile and ended 8 us after the routed chain in
every layer; a tile of 32 rows with K in 4 splits took the step from 444 to 485 tok/s
(`decode-h200-moonlight-v10-shared-down-*.json`). So this sweep patches one table entry at
a time (coordinate descent over a few stages of candidates), captures the bucket's graph
again and times its replay on real decode inputs.

Entries per bucket: the routed experts' (`T{b}_A{k}_E{e}_...`) and the shared expert's
(`T{b}_A1_E1_...`), at the model's shapes. Writes data/benchmarks/<name>.json (every
candidate's step time) and, with --tuned-dir, the fused_moe table merged into the committed
one (copy it to kernels/triton/configs/ to keep it).

Run on the GPU machine as `python -m batchgen.bench.step_tune`.
"""

from __future__ import annotations

import gc
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import click
import torch

from batchgen.bench.common import write_result
from batchgen.bench.decode_moe import WEIGHTS, log, make_checkpoint, random_prompts

OP = "fused_moe"


@dataclass(frozen=True)
class MoeEntry:
    """One fused_moe table entry a decode step reads: the routed experts' or the shared
    expert's (one expert taken by every token)."""

    role: str  # "routed" | "shared"
    top_k: int
    experts: int
    d: int
    i: int
    fmt: str

    def key(self, bucket: int) -> str:
        from kernels.triton.fused_moe import shape_key

        return shape_key(bucket, self.top_k, self.experts, self.d, self.i, self.fmt)

    def base(self, bucket: int, device: torch.device) -> dict:
        """The config the engine runs now: the table's entry, else the heuristic."""
        from kernels.triton import fused_moe

        if self.role == "shared":
            return fused_moe.dense_config(bucket, self.d, self.i, self.fmt, device)
        return fused_moe.choose_config(
            bucket, self.top_k, self.experts, self.d, self.i, self.fmt, device
        )


def moe_entries(model) -> list[MoeEntry]:
    """The routed and shared entries of the model's MoE layers (all layers share shapes)."""
    from engine.layers.moe import DeepseekMoE

    for module in model.modules():
        if not isinstance(module, DeepseekMoE):
            continue
        out = []
        fused = getattr(module.experts, "cuda_fused", None)
        if fused is not None:
            half = 2 if fused.fmt == "mxfp4" else 1
            e, d, i = fused.w2.shape[0], fused.w2.shape[1], fused.w2.shape[-1] * half
            out.append(MoeEntry("routed", int(model.config.num_experts_per_tok), e, d, i,
                                fused.fmt))  # fmt: skip
        shared = getattr(module, "cuda_shared", None)
        if shared is not None:
            half = 2 if shared.fmt == "mxfp4" else 1
            out.append(MoeEntry("shared", 1, 1, shared.w2.shape[0],
                                shared.w2.shape[-1] * half, shared.fmt))  # fmt: skip
        return out
    return []


def _shared_down_tiles(best: dict) -> list[dict]:
    # the launch that ran long beside the routed kernels
    return [
        dict(best, DOWN={"BLOCK_N": bn, "SPLIT_K": sk}) for bn in (32, 64) for sk in (1, 2, 4, 8)
    ]


def _shared_gate_up_tiles(best: dict) -> list[dict]:
    # K splits (arrival counters; the SWAP_AB tile only) and rows per program
    splits = [dict(best, GU_SPLIT_K=g) for g in (1, 2, 4, 8)] if best.get("SWAP_AB") else []
    return splits + [dict(best, BLOCK_N=bn) for bn in (32, 64, 128)]


def _int8_prefetch(best: dict) -> list[dict]:
    # Next step's loads before this step's math, or each tile just before its own: the
    # first wins alone, the second won beside the shared expert at batch 1 (H200, 2026-11-29)
    return [dict(best, PREFETCH=not best.get("PREFETCH", True))]


def _int8_tiles(best: dict) -> list[dict]:
    return [dict(best, BLOCK_N=bn, num_warps=w) for bn in (32, 64) for w in (4, 8)]


def _int8_down_tiles(best: dict) -> list[dict]:
    return [dict(best, DOWN={"BLOCK_N": bn, "num_warps": w}) for bn in (32, 64) for w in (4, 8)]


def _mma_tiles(best: dict) -> list[dict]:
    return [dict(best, BLOCK_N=bn) for bn in (32, 64, 128)]


def _mma_down_splits(best: dict) -> list[dict]:
    return [dict(best, DOWN={"SPLIT_K": s}) for s in (1, 2, 4)]


def candidate_stages(entry: MoeEntry, base: dict, bucket: int) -> list:
    """Stages of candidates, each a function of the best config so far -> configs to time.
    Kept small: each costs a graph capture (and a compile where the tile is new)."""
    if entry.role == "shared":
        return [_shared_down_tiles, _shared_gate_up_tiles]
    if base.get("KERNEL") == "int8":
        return [_int8_prefetch, _int8_tiles, _int8_down_tiles]
    return [_mma_tiles, _mma_down_splits]


class StepTimer:
    """Times one bucket's decode graph on real decode rows after patching the in-memory
    fused_moe table (kernels.triton.configs caches it; patches are undone by `restore`)."""

    def __init__(self, llm, seqs: list, reps: int = 20) -> None:
        from kernels.triton import configs

        self.runner = llm.engine.runner
        self.seqs, self.reps = seqs, reps
        self.table = configs._table(OP).setdefault(configs.device_key(self.runner.device), {})
        self.original = json.loads(json.dumps(self.table))

    def ms(self, bucket: int, key: str, cfg: dict) -> float:
        """ms per replay of `bucket`'s graph captured with table[key] = cfg; inf when the
        config does not compile, launch or validate."""
        self.table[key] = cfg
        graphs = self.runner.graphs
        try:
            graphs.recapture([bucket])
        except Exception as err:  # a tile can exceed registers or shared memory
            log(f"  skip {cfg}: {type(err).__name__}: {str(err)[:120]}")
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

    def restore(self) -> None:
        self.table.clear()
        self.table.update(self.original)


def tune_bucket(timer: StepTimer, entries: list[MoeEntry], bucket: int) -> tuple[dict, list]:
    """Coordinate descent over each entry's stages; returns ({key: best}, timed rows). The
    shared expert's entry only where the fused MoE runs it (SHARED_FUSED_MAX_TOKENS)."""
    from engine.backends.cuda import SHARED_FUSED_MAX_TOKENS

    device = timer.runner.device
    tuned, rows = {}, []
    for entry in entries:
        if entry.role == "shared" and bucket > SHARED_FUSED_MAX_TOKENS:
            continue
        key = entry.key(bucket)
        best = entry.base(bucket, device)
        best_ms = timer.ms(bucket, key, best)
        rows.append(dict(bucket=bucket, role=entry.role, key=key, config=best, ms=best_ms,
                         base=True))  # fmt: skip
        log(f"batch {bucket} {entry.role} base {best_ms:.3f} ms {best}")
        for stage in candidate_stages(entry, best, bucket):
            for cfg in stage(best):
                if cfg == best:
                    continue
                ms = timer.ms(bucket, key, cfg)
                rows.append(dict(bucket=bucket, role=entry.role, key=key, config=cfg, ms=ms))
                log(f"batch {bucket} {entry.role} {ms:.3f} ms {cfg}")
                if ms < best_ms:
                    best, best_ms = cfg, ms
        timer.table[key] = best  # later entries are timed beside this one's best
        tuned[key] = best
        log(f"batch {bucket} {entry.role} best {best_ms:.3f} ms {best}")
    return tuned, rows


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
        timer.restore()
        del timer, seqs, model, llm
        gc.collect()
        torch.cuda.empty_cache()
    return {"tuned": tuned, "rows": rows}


def write_table(tuned: dict, tuned_dir: Path, device_name: str) -> Path:
    """The committed fused_moe table with these entries merged in under `device_name`
    (configs.device_key), written to tuned_dir."""
    from kernels.triton.configs import CONFIG_DIR

    committed = CONFIG_DIR / f"{OP}.json"
    merged = json.loads(committed.read_text()) if committed.exists() else {}
    merged.setdefault(device_name, {}).update(tuned)
    tuned_dir.mkdir(parents=True, exist_ok=True)
    out = tuned_dir / f"{OP}.json"
    out.write_text(json.dumps(merged, indent=1) + "\n")
    return out


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
    if not torch.cuda.is_available():
        raise click.UsageError("bench step-tune needs a CUDA GPU")
    chosen = [w.strip() for w in weights.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in WEIGHTS]
    if unknown:
        raise click.BadParameter(f"unknown weights {unknown}; choose from {sorted(WEIGHTS)}")
    buckets = tuple(int(b) for b in batches.split(",") if b.strip())
    payload: dict = {"preset": preset, "layers": layers, "prompt_tokens": prompt_len,
                     "results": [], "tuned": {}}  # fmt: skip
    for w in chosen:
        t0 = time.perf_counter()
        path = make_checkpoint(workdir, preset, layers, w)
        out = tune_weights(path, w, buckets, prompt_len)
        shutil.rmtree(path, ignore_errors=True)
        payload["results"] += out["rows"]
        payload["tuned"].update(out["tuned"])
        log(f"{w}: tuned in {time.perf_counter() - t0:.0f} s")
        write_result(name, payload)  # after each weight format: a cut-off run keeps its rows
    if tuned_dir is not None:
        from kernels.triton.configs import device_key

        log(f"wrote {write_table(payload['tuned'], tuned_dir, device_key(torch.device('cuda')))}")
    log(f"wrote {write_result(name, payload)}")


if __name__ == "__main__":
    command()
