"""`batchgen report RUN_DIR`: rebuild and print a run's report (finished or not)."""

from __future__ import annotations

import json
import sys

import click


@click.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False))
def report_cmd(run_dir: str) -> None:
    """Rebuild report.json/.md/.png of RUN_DIR from its results and print report.md."""
    from batchgen.report import render_markdown, write_report
    from batchgen.run_dir import RunDir

    rd = RunDir(run_dir)
    if not rd.exists():
        click.echo(f"error: {run_dir} is not a batchgen run directory (no job.json)", err=True)
        sys.exit(2)
    previous = rd.path / "report.json"
    exit_code = total = None
    if previous.exists():
        old = json.loads(previous.read_text())
        exit_code, total = old.get("exit_code"), old.get("rows_total")
    report = write_report(rd, None, None, exit_code=exit_code, total_rows=total)
    click.echo(render_markdown(report))


commands = [report_cmd]
