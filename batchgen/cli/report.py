"""`batchgen report RUN_DIR`: rebuild and print a run's report (finished or not);
`--verify` checks the run directory instead, changing nothing."""

from __future__ import annotations

import json
import sys

import click


@click.command("report")
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option(
    "--verify",
    is_flag=True,
    help="Check every committed part against its manifest line (size, checksum) and "
    "report damaged, missing or stray files; exit 2 if any. Changes nothing.",
)
def report_cmd(run_dir: str, verify: bool) -> None:
    """Rebuild report.json/.md/.png of RUN_DIR from its results and print report.md."""
    from batchgen.run_dir import RunDir

    rd = RunDir(run_dir)
    if not rd.exists():
        click.echo(f"error: {run_dir} is not a batchgen run directory (no job.json)", err=True)
        sys.exit(2)
    if verify:
        from batchgen.run_dir_check import verify as verify_run
        from batchgen.run_lock import held_by

        lines, whole = verify_run(rd)
        holder = held_by(rd.path)
        if holder is not None:
            lines.append(
                f"note: a run is writing here now ({holder}): a part it has not committed "
                "yet shows as not committed"
            )
        for line in lines:
            click.echo(line)
        sys.exit(0 if whole else 2)

    import pyarrow as pa

    from batchgen.report import render_markdown, write_report

    previous = rd.path / "report.json"
    exit_code = total = None
    if previous.exists():
        old = json.loads(previous.read_text())
        exit_code, total = old.get("exit_code"), old.get("rows_total")
    try:
        report = write_report(rd, None, None, exit_code=exit_code, total_rows=total)
    except (OSError, pa.ArrowException) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        click.echo(
            f"error: the report of {run_dir} cannot be built: {reason}; "
            f"`batchgen report {run_dir} --verify` names the damaged parts, a rerun of the "
            "job repairs them",
            err=True,
        )
        sys.exit(2)
    click.echo(render_markdown(report))


commands = [report_cmd]
