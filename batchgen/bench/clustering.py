"""`batchgen bench clustering`: clustering a million short prompts on this machine, with the
memory it takes.

What is measured, and how (embedding is the slow stage, so it is measured on a sample and
extrapolated rather than run on every prompt):

1. input: ROWS short prompts written to a Parquet file (the 576 prompts of
   data/tasks/mixed_tasks.parquet, each made unique by a reference number), read back
   batch by batch like a job's input;
2. embedding: the real embedding model on the first EMBED_SAMPLE prompts -> prompts/s
   (model load timed apart);
3. pipeline: batchgen.task_clusters on all ROWS prompts, end to end (text hashing, the
   on-disk embedding cache, the spill, k chosen by silhouette, k-means fit on a 50k sample,
   assignment of every row, small-cluster merge, naming, assignments.parquet), with the
   model replaced by a replay of the real vectors of step 2: prompt i gets the vector of
   sample prompt i mod EMBED_SAMPLE. Peak RSS is sampled during this stage;
4. the estimate for the whole job = ROWS / measured prompts/s + the pipeline time.
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path

import click

from batchgen.bench.common import PeakRss, write_result

MIXED_TASKS = Path(__file__).resolve().parents[2] / "data" / "tasks" / "mixed_tasks.parquet"


class ReplayEmbedder:
    """Stands in for the model in the pipeline stage: the n-th text it is asked to embed
    gets real vector n mod len(vectors). Same interface as clustering.embed.Embedder."""

    def __init__(self, vectors, fingerprint: str):
        self.vectors = vectors
        self.fingerprint = f"replay-{fingerprint}"
        self.dim = vectors.shape[1]
        self.texts_embedded = 0

    def embed(self, texts):
        import numpy as np

        index = np.arange(self.texts_embedded, self.texts_embedded + len(texts)) % len(self.vectors)
        self.texts_embedded += len(texts)
        return self.vectors[index]


def write_prompts(path: Path, rows: int) -> None:
    """ROWS short prompts, unique, tasks interleaved, in Parquet row groups of 64k."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    base = pq.read_table(MIXED_TASKS, columns=["prompt"]).column("prompt").to_pylist()
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, 65536):
            stop = min(start + 65536, rows)
            ids = [f"p{i:08d}" for i in range(start, stop)]
            prompts = [f"{base[i % len(base)]} (ref {i})" for i in range(start, stop)]
            writer.write_table(pa.table({"id": ids, "prompt": prompts}, schema=schema))


def read_prompts(path: Path, limit: int | None = None):
    """(id, prompt) batch by batch, never the whole file."""
    import pyarrow.parquet as pq

    seen = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=8192):
        for row_id, prompt in zip(
            batch.column("id").to_pylist(), batch.column("prompt").to_pylist()
        ):
            if limit is not None and seen >= limit:
                return
            seen += 1
            yield row_id, prompt


def run_benchmark(rows: int, embed_sample: int, work_dir: Path, device: str = "auto") -> dict:
    import numpy as np

    from batchgen.task_clusters import ClusterSettings, build_task_clusters
    from clustering.embed import Embedder

    input_path = work_dir / "prompts.parquet"
    load_average_start = os.getloadavg()
    started = time.perf_counter()
    write_prompts(input_path, rows)
    input_s = time.perf_counter() - started

    started = time.perf_counter()
    embedder = Embedder(device=device)
    dim = embedder.dim  # loads the model
    load_s = time.perf_counter() - started
    sample_texts = [text for _, text in read_prompts(input_path, embed_sample)]
    started = time.perf_counter()
    vectors = np.concatenate(
        [embedder.embed(sample_texts[i : i + 4096]) for i in range(0, len(sample_texts), 4096)]
    )
    embed_s = time.perf_counter() - started
    embed_rate = len(sample_texts) / embed_s
    rss_after_model = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    replay = ReplayEmbedder(vectors, embedder.fingerprint)
    settings = ClusterSettings()
    started = time.perf_counter()
    with PeakRss() as rss:
        result = build_task_clusters(
            read_prompts(input_path), work_dir / "clusters", settings, embedder=replay
        )
    pipeline_s = time.perf_counter() - started
    assert result.rows == rows and replay.texts_embedded == rows

    embed_all_s = rows / embed_rate
    return {
        "rows": rows,
        "device": embedder.device,
        "embedding_model": embedder.fingerprint,
        "embedding_dim": dim,
        "settings": {
            "sample_size": settings.sample_size,
            "min_cluster_size": settings.min_cluster_size,
            "max_k": settings.max_k,
        },
        "measured": {
            "write_input_s": round(input_s, 1),
            "model_load_s": round(load_s, 1),
            "embed_sample_rows": len(sample_texts),
            "embed_sample_s": round(embed_s, 1),
            "embed_prompts_per_s": round(embed_rate, 1),
            "pipeline_rows": rows,
            "pipeline_s": round(pipeline_s, 1),
            "pipeline_prompts_per_s": round(rows / pipeline_s, 1),
            "pipeline_peak_rss_mb": round(rss.peak / 2**20, 1),
            "pipeline_rss_at_start_mb": round(rss.start_rss / 2**20, 1),
            "pipeline_peak_rss_anon_mb": round(rss.peak_anon / 2**20, 1),
            "pipeline_rss_anon_at_start_mb": round(rss.start_anon / 2**20, 1),
            "process_peak_rss_mb_before_pipeline": round(rss_after_model / 2**20, 1),
            "clusters": len(result.clusters),
            "k_scores": {str(k): round(v, 4) for k, v in result.k_scores.items()},
        },
        "estimated": {
            "embed_all_s": round(embed_all_s, 1),
            "total_s": round(embed_all_s + pipeline_s, 1),
            "total_h": round((embed_all_s + pipeline_s) / 3600, 2),
            "how": "rows / measured embedding prompts/s + measured pipeline time",
        },
        # The machine is shared: its load during the run says how far these numbers sit
        # below what the same cores do when idle.
        "load_average_start": [round(x, 2) for x in load_average_start],
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "note": (
            "The pipeline stage ran on every row with the model replaced by a replay of the "
            f"{len(sample_texts):,} real sample vectors (row i gets sample vector i mod "
            f"{len(sample_texts):,}); embedding every row was not run, it is estimated from "
            "the measured rate."
        ),
    }


@click.command("clustering")
@click.option("--rows", type=click.IntRange(min=1000), default=1_000_000, show_default=True)
@click.option(
    "--embed-sample",
    type=click.IntRange(min=100),
    default=20_000,
    show_default=True,
    help="Prompts embedded for real to measure prompts/s.",
)
@click.option("--device", default="auto", show_default=True)
@click.option("--name", default=None, help="JSON name (default: clustering-cpu / -cuda).")
@click.option("--work-dir", type=click.Path(file_okay=False), help="Scratch (default: a temp dir).")
def command(rows: int, embed_sample: int, device: str, name: str | None, work_dir: str | None):
    """Cluster ROWS short prompts with bounded memory; record prompts/s, time, peak RSS."""
    embed_sample = min(embed_sample, rows)
    with tempfile.TemporaryDirectory(dir=work_dir) as scratch:
        payload = run_benchmark(rows, embed_sample, Path(scratch), device)
    name = name or f"clustering-{'cuda' if payload['device'].startswith('cuda') else 'cpu'}"
    path = write_result(name, payload)
    print_table(payload)
    click.echo(f"wrote {path}")


def print_table(payload: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = payload["rows"]
    table = Table(title=f"clustering {rows:,} prompts ({payload['device']})")
    table.add_column("stage")
    table.add_column("value", justify="right")
    m, e = payload["measured"], payload["estimated"]
    table.add_row(
        f"embedding ({m['embed_sample_rows']:,} real prompts)",
        f"{m['embed_prompts_per_s']:,} prompts/s",
    )
    table.add_row(f"pipeline on {rows:,} rows (replayed vectors)", f"{m['pipeline_s']:,} s")
    table.add_row("pipeline peak RSS (all)", f"{m['pipeline_peak_rss_mb']:,} MB")
    table.add_row("pipeline peak RSS (anonymous)", f"{m['pipeline_peak_rss_anon_mb']:,} MB")
    table.add_row("clusters", str(m["clusters"]))
    table.add_row("estimated embedding of every row", f"{e['embed_all_s']:,} s")
    table.add_row("estimated total", f"{e['total_h']} h")
    Console().print(table)
