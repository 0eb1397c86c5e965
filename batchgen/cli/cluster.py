"""`batchgen cluster JOB --out assignments.parquet`: embed and cluster the job's rendered
prompts without running the model; write id, cluster_id, cluster_name and show the
clusters."""

from __future__ import annotations

import shutil
from pathlib import Path

import click

from batchgen.cli.run import refuse, setup_logging
from batchgen.job_spec import JobError, load_job

EXAMPLE_CHARS = 90


def print_clusters(result, console=None) -> None:
    """A rich table: one line per cluster with its size, name and example prompt."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    total = max(result.rows, 1)
    table = Table(title=f"{len(result.clusters)} clusters over {result.rows:,} prompts")
    table.add_column("cluster", justify="right")
    table.add_column("size", justify="right")
    table.add_column("share", justify="right")
    table.add_column("name")
    table.add_column("example prompt", overflow="fold")
    for c in result.clusters:
        example = " ".join(c.example.split())
        if len(example) > EXAMPLE_CHARS:
            example = example[: EXAMPLE_CHARS - 1] + "…"
        table.add_row(str(c.cluster_id), f"{c.size:,}", f"{c.size / total:.1%}", c.name, example)
    if result.unassigned:
        table.add_row(
            "-", f"{result.unassigned:,}", f"{result.unassigned / total:.1%}", "(no prompt)", ""
        )
    console.print(table)


@click.command("cluster")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option(
    "--out", "out", required=True, type=click.Path(dir_okay=False), help="Assignments Parquet."
)
@click.option("--k", "k", type=click.IntRange(min=1), help="Fixed number of clusters.")
@click.option(
    "--min-cluster-size",
    type=click.IntRange(min=1),
    help="Smallest cluster kept (default: the job's max_num_seqs, else 64).",
)
@click.option("--embedding-model", help="sentence-transformers model directory.")
@click.option(
    "--work-dir",
    type=click.Path(file_okay=False),
    help="Where embeddings are cached (default: next to --out, OUT_STEM.clusters/).",
)
def cluster_cmd(job_file, out, k, min_cluster_size, embedding_model, work_dir) -> None:
    """Cluster JOB_FILE's prompts by task type; the model is not run."""
    from dataclasses import replace

    from batchgen.job_context import open_job
    from batchgen.planner import cluster_mode
    from batchgen.task_clusters import (
        build_task_clusters,
        label_clusters,
        prompt_texts,
        settings_for_job,
    )

    setup_logging()
    try:
        job = load_job(job_file)
        ctx = open_job(job)
    except JobError as exc:
        refuse(exc)
    out_path = Path(out)
    work = Path(work_dir) if work_dir else out_path.with_name(out_path.stem + ".clusters")
    mode = cluster_mode(job.batching)
    if mode == "column":
        column = job.batching.cluster
        click.echo(f"batching.cluster names the column '{column}': one cluster per label")

        def labelled_rows():
            return ((row.id, row.values.get(column)) for row in ctx.input.rows())

        result = label_clusters(labelled_rows, work)
    else:
        if mode == "off":
            click.echo("batching.cluster is off for runs; clustering anyway as asked")
        settings = settings_for_job(job)
        overrides = {
            "k": k if k is not None else settings.k,
            "min_cluster_size": min_cluster_size or settings.min_cluster_size,
            "embedding_model": embedding_model or settings.embedding_model,
        }
        from batchgen.progress import Progress

        progress = Progress(None)  # a bar on a terminal, else JSON lines on stderr
        try:
            result = build_task_clusters(
                prompt_texts(job, ctx.input.rows()),
                work,
                replace(settings, **overrides),
                on_progress=progress.phase,
                total_rows=ctx.total_rows,
            )
        finally:
            progress.close()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(result.assignments_path, out_path)
    print_clusters(result)
    click.echo(f"wrote {result.rows:,} assignments to {out_path} (embedding cache: {work})")


commands = [cluster_cmd]
