"""`batchgen bench ray --workers 1,2`: rows/s of one job on the Ray executor with 1, 2, ...
workers against the local executor on the same machine, so the table shows Ray's
overhead (1 worker against local) and the scaling (more workers).

Every run is a fresh run directory of the same job: by default the tiny random llama and
short prompts on CPU workers (`--cpus-per-worker` torch threads each; the local run gets
the same thread count); `--model PATH --gpu` runs a real model with one GPU per worker.
Two figures per run: rows over the whole session's wall time (model loads and Ray's
start included), and the steady rate between the first and the last committed part.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import click

from batchgen.bench.common import write_result
from batchgen.bench.pipeline_memory import write_input
from batchgen.bench.tiny_llama import write_tiny_llama


def _job(model: str, data: Path, run: Path, args: dict, executor: dict | None) -> dict:
    job = {
        "input": {"path": str(data), "id_column": "id"},
        "prompt": {"template": "{{ text }}"},
        "model": {"path": model, "device": "cuda" if args["gpu"] else "cpu"},
        "sampling": {"temperature": 0.0, "max_tokens": args["max_tokens"]},
        "batching": {"cluster": "off", "max_num_seqs": args["max_num_seqs"]},
        "output": {"path": str(run), "rows_per_part": args["rows_per_part"]},
    }
    if not args["gpu"]:
        job["model"]["kv_cache_memory"] = 64 * 2**20
    if executor is not None:
        job["executor"] = executor
    return job


def _measure(job_dict: dict, run: Path) -> dict:
    from batchgen.job_spec import parse_job
    from batchgen.progress import Progress

    job = parse_job(job_dict)
    progress = Progress(None, tty=False, interval=3600)
    t0 = time.perf_counter()
    if job.executor.type == "ray":
        from batchgen.executors.ray_executor import run_job_on_ray

        outcome = run_job_on_ray(job, "bench", progress=progress)
    else:
        from batchgen.run import run_job

        outcome = run_job(job, "bench", progress=progress)
    wall = time.perf_counter() - t0
    if outcome.exit_code != 0:
        raise click.ClickException(f"the benchmark job failed: {outcome.message}")
    lines = [json.loads(x) for x in (run / "_manifest.jsonl").read_text().splitlines()]
    rows = sum(e["rows"] for e in lines)
    times = sorted(e["time"] for e in lines)
    after_first = rows - min(lines, key=lambda e: e["time"])["rows"]
    span = times[-1] - times[0]
    return {
        "rows": rows,
        "wall_s": round(wall, 2),
        "rows_per_s": round(rows / wall, 2),
        "steady_rows_per_s": round(after_first / span, 2) if span > 0 else None,
        "parts": len(lines),
        "workers_used": len({e.get("worker") for e in lines}),
    }


def run_benchmark(workers: list[int], args: dict, base: Path) -> dict:
    """Run the job locally, then on Ray with each worker count; the payload."""
    import ray

    base.mkdir(parents=True, exist_ok=True)
    data = base / "input.parquet"
    write_input(data, args["rows"])
    model = args["model"]
    if model is None:
        corpus = ["Please check the invoice for the team."] * 40
        model = str(write_tiny_llama(base / "tiny-llama", corpus))
    threads = args["cpus_per_worker"]
    if not args["gpu"]:
        import torch

        torch.set_num_threads(threads)  # the local run computes on as many threads as a worker
    runs = []
    local_run = base / "local"
    runs.append(
        {"executor": "local", **_measure(_job(model, data, local_run, args, None), local_run)}
    )
    click.echo(f"local: {runs[-1]}")
    if args["gpu"]:
        import gc

        import torch

        # The local engine's memory back to the GPU before a worker process measures
        # what it may take for its KV cache.
        gc.collect()
        torch.cuda.empty_cache()
    resources = {"GPU": 1} if args["gpu"] else {"CPU": threads}
    ray.init(
        address=args["address"] or "local",  # "local": never a stale cluster of this host
        num_cpus=None if args["address"] else max(workers) * threads,
        include_dashboard=False,
        logging_level="WARNING",
        log_to_driver=False,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        for n in workers:
            run = base / f"ray-{n}"
            executor = {"type": "ray", "num_workers": n, "resources_per_worker": resources}
            runs.append(
                {
                    "executor": "ray",
                    "num_workers": n,
                    **_measure(_job(model, data, run, args, executor), run),
                }
            )
            click.echo(f"ray, {n} workers: {runs[-1]}")
    finally:
        ray.shutdown()
    return {"settings": {**args, "model": model, "workers": workers}, "runs": runs}


@click.command("ray")
@click.option("--workers", default="1,2", show_default=True, help="Worker counts, comma-separated.")
@click.option("--rows", default=400, show_default=True)
@click.option("--max-tokens", default=16, show_default=True)
@click.option("--max-num-seqs", default=32, show_default=True)
@click.option("--rows-per-part", default=50, show_default=True)
@click.option("--cpus-per-worker", default=1, show_default=True)
@click.option("--model", default=None, help="A model path (default: the tiny random llama).")
@click.option("--gpu", is_flag=True, help="One GPU per worker; the model on CUDA.")
@click.option("--address", default=None, help="A running Ray cluster (default: a new local one).")
def command(workers: str, **args) -> None:
    """Rows/s on the Ray executor against the local executor."""
    counts = [int(w) for w in workers.split(",") if w.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-ray-") as tmp:
        payload = run_benchmark(counts, args, Path(tmp))
    click.echo(
        f"{'executor':<10} {'workers':>7} {'rows':>6} {'wall s':>8} {'rows/s':>8} {'steady':>8}"
    )
    for r in payload["runs"]:
        click.echo(
            f"{r['executor']:<10} {r.get('num_workers', '-'):>7} {r['rows']:>6} {r['wall_s']:>8} "
            f"{r['rows_per_s']:>8} {r['steady_rows_per_s'] or '-':>8}"
        )
    path = write_result("ray-executor-gpu" if args["gpu"] else "ray-executor-cpu", payload)
    click.echo(f"wrote {path}")
