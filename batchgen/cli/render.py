"""`batchgen render JOB --n 5`: the first rows' prompts exactly as the model will see them."""

from __future__ import annotations

import click

from batchgen.cli.run import refuse, setup_logging
from batchgen.job_spec import JobError, load_job


@click.command("render")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--n", "count", type=int, default=5, show_default=True, help="Rows to show.")
def render_cmd(job_file: str, count: int) -> None:
    """Print fully rendered prompts (system prompt and chat template applied)."""
    from batchgen.job_context import open_job
    from batchgen.run import load_llm, make_renderer

    setup_logging()
    try:
        job = load_job(job_file)
        ctx = open_job(job, check_ids=False)
        llm = load_llm(job)
        renderer = make_renderer(ctx, llm)
    except JobError as exc:
        refuse(exc)
    for i, row in enumerate(ctx.input.rows()):
        if i >= count:
            break
        prepared = renderer.prepare(row)
        click.echo(f"===== row {row.seq}  id {row.id!r} =====")
        if prepared.error is not None:
            click.echo(f"[error row: {prepared.error.type}] {prepared.error.message}")
            continue
        note = " (truncated by the overflow policy)" if prepared.truncated else ""
        click.echo(f"[{prepared.num_prompt_tokens} tokens{note}]")
        click.echo(llm.tokenizer.decode(prepared.prompt_token_ids, skip_special_tokens=False))


commands = [render_cmd]
