"""`batchgen bench pipeline-memory`: peak RSS of a whole job over a large input.

The job runs through the real pipeline and the real engine, on a tiny random llama (so the
model's own footprint is small and the figure is the pipeline's) with one output token per
row. RSS is sampled every 50 ms; the figure reported is peak RSS minus the RSS after the
model was loaded, i.e. what the pipeline adds on top of the model. The bound to hold is
1.5 GB for 2 million rows.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq

from batchgen.bench.common import PeakRss, write_result
from batchgen.bench.tiny_llama import write_tiny_llama

_KV_BYTES = 64 * 2**20
BOUND_MB = 1536  # what the pipeline may add above the model at 2 million rows
_WORDS = ["invoice", "meeting", "shipment", "budget", "contract", "customer", "report", "team"]


def write_input(path: Path, rows: int, chunk: int = 100_000) -> None:
    """Write `rows` short distinct business-like prompts without holding them all."""
    schema = pa.schema([("id", pa.string()), ("text", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            ids = [f"row-{i:09d}" for i in range(start, start + n)]
            texts = [
                f"Please check the {_WORDS[i % 8]} {i} for the {_WORDS[(i // 8) % 8]} team."
                for i in range(start, start + n)
            ]
            writer.write_table(pa.table({"id": ids, "text": texts}, schema=schema))


def run_benchmark(rows: int, max_num_seqs: int, base: Path) -> dict:
    """Write the input and the tiny model under `base`, run the job, return the payload
    (peak RSS above the RSS after the model load, the bound, rows/s)."""
    from batchgen.job_spec import parse_job
    from batchgen.progress import Progress
    from batchgen.run import run_job
    from engine import LLM

    base.mkdir(parents=True, exist_ok=True)
    data = base / "input.parquet"
    t0 = time.time()
    write_input(data, rows)
    click.echo(f"input: {rows:,} rows written in {time.time() - t0:.1f}s -> {data}")
    corpus = [f"Please check the {w} for the team." for w in _WORDS] * 20
    model_dir = write_tiny_llama(base / "tiny-llama", corpus)
    job = parse_job(
        {
            "input": {"path": str(data), "id_column": "id"},
            # no chat template: the figure is the pipeline's memory, and short prompts let
            # 2 million rows through a 2-core machine in reasonable time
            "prompt": {"template": "{{ text }}", "chat": False},
            "model": {"path": str(model_dir), "device": "cpu", "kv_cache_memory": _KV_BYTES},
            "sampling": {"temperature": 0.0, "max_tokens": 1},
            "batching": {
                "cluster": "off",
                "max_num_seqs": max_num_seqs,
                "max_num_batched_tokens": 8192,
            },
            "output": {"path": str(base / "run"), "rows_per_part": 10_000},
        }
    )
    # A fixed, small KV cache: its pages are touched as blocks get used, and that growth
    # belongs to the model's footprint, not the pipeline's.
    llm = LLM(
        str(model_dir),
        device="cpu",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        kv_cache_memory=_KV_BYTES,
    )
    with open(os.devnull, "w") as devnull, PeakRss() as peak:
        baseline = peak.start_rss
        start = time.time()
        progress = Progress(base / "progress.json", interval=30, tty=False, stream=devnull)
        outcome = run_job(job, "bench", llm=llm, progress=progress)
        elapsed = time.time() - start
    above = peak.peak - baseline
    return {
        "rows": rows,
        "exit_code": outcome.exit_code,
        "rss_after_model_load_mb": round(baseline / 2**20, 1),
        "peak_rss_mb": round(peak.peak / 2**20, 1),
        "peak_above_model_mb": round(above / 2**20, 1),
        "bound_mb": BOUND_MB,
        "within_bound": above < BOUND_MB * 2**20,
        "wall_s": round(elapsed, 1),
        "rows_per_s": round(rows / elapsed, 1),
        "max_num_seqs": max_num_seqs,
    }


@click.command("pipeline-memory")
@click.option("--rows", type=int, default=2_000_000, show_default=True)
@click.option("--max-num-seqs", type=int, default=256, show_default=True)
@click.option("--workdir", type=click.Path(file_okay=False), default=None)
def command(rows: int, max_num_seqs: int, workdir: str | None) -> None:
    """Peak RSS above the model's footprint for a job of ROWS rows (tiny model, 1 token)."""
    base = Path(workdir or tempfile.mkdtemp(prefix="bench-pipeline-memory-"))
    payload = run_benchmark(rows, max_num_seqs, base)
    path = write_result(f"pipeline-memory-{rows}", payload)
    click.echo(f"{'rows':<28}{rows:,}")
    for key in ("exit_code", "rss_after_model_load_mb", "peak_rss_mb", "peak_above_model_mb",
                "within_bound", "wall_s", "rows_per_s"):  # fmt: skip
        click.echo(f"{key:<28}{payload[key]}")
    click.echo(f"written: {path}")
