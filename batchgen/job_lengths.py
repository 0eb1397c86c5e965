"""The sequence length a job's engine sizes its batch by (max_num_seqs "auto",
engine/batch_size.py): the mean over a sample of the job's rows of prompt tokens plus the
output tokens the row may generate, each completion a sequence of its own."""

from __future__ import annotations

import itertools

from batchgen.job_context import JobContext
from batchgen.row_preparer import RowPreparer

SAMPLE_ROWS = 256


def expected_seq_len(ctx: JobContext, sample_rows: int = SAMPLE_ROWS) -> int | None:
    """Mean prompt + max output tokens of the first `sample_rows` rows that render (None:
    none does; the engine then assumes its context length). Reads only those rows."""
    from engine.loader import open_model_source

    job = ctx.job
    try:
        source = open_model_source(job.model.path)
    except (OSError, ValueError, RuntimeError):
        return None  # the engine's load says what is wrong, by name
    tokenizer = source.tokenizer
    if tokenizer is None:
        return None
    # the model's declared context (never a load of the model to learn its default)
    context = min(x for x in (source.declared_context, job.model.max_model_len, 1 << 30) if x)
    preparer = RowPreparer(job, tokenizer, context, ctx.carry_map, ctx.format)
    lengths = []
    for row in itertools.islice(ctx.input.rows(), sample_rows):
        prepared = preparer.prepare(row)
        if prepared.error is not None:
            continue
        sampling = prepared.sampling or preparer.base
        lengths.append(min(context, prepared.num_prompt_tokens + sampling.max_tokens))
    if not lengths:
        return None
    return -(-sum(lengths) // len(lengths))
