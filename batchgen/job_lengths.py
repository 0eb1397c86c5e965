"""The sequence length a job's engine sizes its batch by (max_num_seqs "auto",
engine/batch_size.py): the mean over a sample of the job's rows of prompt tokens plus the
output tokens the row may generate, each completion a sequence of its own."""

from __future__ import annotations

import itertools

from batchgen.job_context import JobContext, open_tokenizer
from batchgen.row_preparer import RowPreparer

SAMPLE_ROWS = 256


def expected_seq_len(ctx: JobContext, sample_rows: int = SAMPLE_ROWS) -> int | None:
    """Mean prompt + max output tokens of the first `sample_rows` rows that render (None:
    none does; the engine then assumes its context length). Reads only those rows."""
    job = ctx.job
    tokenizer, context = open_tokenizer(job)
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
