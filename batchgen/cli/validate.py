"""`batchgen validate JOB`: the checks and counts of a run, without running the job."""

from __future__ import annotations

import click

from batchgen.cli.run import refuse, setup_logging
from batchgen.job_spec import JobError, load_job


@click.command("validate")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--no-calibrate", is_flag=True, help="Skip the short timing run of the model.")
def validate_cmd(job_file: str, no_calibrate: bool) -> None:
    """Check JOB_FILE and count rows and tokens; estimate the run time."""
    from batchgen.job_context import open_job, open_tokenizer
    from batchgen.resume import check_run_dir
    from batchgen.row_preparer import RowPreparer
    from batchgen.run import load_llm, make_renderer
    from batchgen.validate import calibrate, check_template_sample, count_rows, refuse_unrunnable

    setup_logging()
    llm = None
    try:
        job = load_job(job_file)
        ctx = open_job(job)
        check_run_dir(job, new_run=False)
        if no_calibrate:  # the tokenizer alone renders and counts
            tokenizer, context = open_tokenizer(job)
            renderer = RowPreparer(job, tokenizer, context, ctx.carry_map, ctx.format)
        else:
            llm = load_llm(job)
            renderer = make_renderer(ctx, llm)
        check_template_sample(ctx, renderer)
        report = count_rows(ctx, renderer)
        refuse_unrunnable(report)
    except JobError as exc:
        refuse(exc)
    if llm is not None:
        calibrate(ctx, renderer, llm, report)
    click.echo(f"job {job_file}: ok (fingerprint {job.fingerprint})")
    click.echo(f"model: {job.model.path}, context {renderer.max_model_len} tokens")
    for line in report.lines():
        click.echo(line)


commands = [validate_cmd]
