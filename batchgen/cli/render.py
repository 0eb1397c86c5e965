"""`batchgen render JOB --n 5`: the first rows' prompts exactly as the model will see them.
Only the model's tokenizer is loaded, never its weights."""

from __future__ import annotations

import click

from batchgen.cli.run import refuse, setup_logging
from batchgen.job_spec import JobError, load_job
from batchgen.prompt_data import special_token_pattern


@click.command("render")
@click.argument("job_file", type=click.Path(dir_okay=False))
@click.option("--n", "count", type=int, default=5, show_default=True, help="Rows to show.")
def render_cmd(job_file: str, count: int) -> None:
    """Print fully rendered prompts (system prompt and chat template applied)."""
    from batchgen.job_context import open_job, open_tokenizer
    from batchgen.row_preparer import RowPreparer

    setup_logging()
    try:
        job = load_job(job_file)
        ctx = open_job(job, check_ids=False)
        tokenizer, context = open_tokenizer(job)
        renderer = RowPreparer(job, tokenizer, context, ctx.carry_map, ctx.format)
        for i, row in enumerate(ctx.input.rows()):
            if i >= count:
                break
            _show(renderer, tokenizer, row)
    except JobError as exc:
        refuse(exc)


def _show(renderer, tokenizer, row) -> None:
    prepared = renderer.prepare(row)
    click.echo(f"===== row {row.seq}  id {row.id!r} =====")
    if prepared.error is not None:
        click.echo(f"[error row: {prepared.error.type}] {prepared.error.message}")
        return
    ids = prepared.prompt_token_ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    notes = []
    if prepared.truncated:
        notes.append("truncated by the overflow policy")
    # Special-token strings from row values print like the real ones but are plain text.
    pattern = special_token_pattern(tokenizer.special_tokens)
    printed = len(pattern.findall(text)) if pattern is not None else 0
    as_text = printed - sum(1 for t in ids if t in tokenizer.special_token_ids)
    if as_text > 0:
        notes.append(f"{as_text} special-token string(s) from the row's values are plain text")
    note = f" ({'; '.join(notes)})" if notes else ""
    click.echo(f"[{prepared.num_prompt_tokens} tokens{note}]")
    click.echo(text)


commands = [render_cmd]
