"""`batchgen export RUN_DIR --format openai_batch|anthropic_batch --out DIR`: a run's
results as the files the OpenAI Batch API (and `vllm run-batch`) or Anthropic Message
Batches return."""

from __future__ import annotations

import click

from batchgen.cli.run import refuse
from batchgen.job_spec import JobError


@click.command("export")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["openai_batch", "anthropic_batch"]),
    required=True,
    help="openai_batch: output.jsonl + errors.jsonl; anthropic_batch: results.jsonl.",
)
@click.option("--out", "out_dir", type=click.Path(file_okay=False), required=True)
@click.option("--partial", is_flag=True, help="Export an unfinished run's committed rows.")
def export_cmd(run_dir: str, fmt: str, out_dir: str, partial: bool) -> None:
    """Write RUN_DIR's results as batch-API result files in --out."""
    from batchgen.batch_api.export import export_run

    try:
        summary = export_run(run_dir, fmt, out_dir, partial=partial)
    except JobError as exc:
        refuse(exc)
    files = ", ".join(f"{name} ({lines:,} lines)" for name, lines in summary.files.items())
    click.echo(
        f"exported {summary.succeeded:,} succeeded and {summary.errored:,} errored requests "
        f"-> {out_dir}: {files}"
    )


commands = [export_cmd]
