"""Everything checked and derived from a job before any work: the input opened, its column
types, text and ids checked, the columns the template needs, the carried columns and their
output names, the model path. `run`, `validate` and `render` all start here; a JobError
from here means exit 2 with nothing written."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from batchgen.batch_api.jsonl_input import BatchFileInput, detect_format
from batchgen.job_spec import BATCH_FILE_FORMATS, JobError, JobSpec
from batchgen.planner import cluster_mode
from batchgen.reader import ParquetInput
from batchgen.render import template_columns
from batchgen.writer import output_column_for, result_schema


@dataclass
class JobContext:
    job: JobSpec
    input: ParquetInput | BatchFileInput
    carry_map: dict[str, str]  # input column -> output column
    schema: pa.Schema  # of the result parts
    total_rows: int
    format: str = "parquet"  # input format: parquet | openai_batch | anthropic_batch


def check_model_path(path: str) -> None:
    """A model is a local directory, a GGUF file, an alias the engine's catalog knows, or a
    spec of a registered scheme (`random:...`, checked in full when it is opened)."""
    if Path(path).exists():
        return
    from engine.loader.catalog import is_alias
    from engine.loader.model_source import spec_scheme

    if is_alias(path) or spec_scheme(path) is not None:
        return
    raise JobError(
        f"model.path: '{path}' is neither an existing directory or file nor a known model "
        "alias (see `batchgen models list`)"
    )


def open_tokenizer(job: JobSpec):
    """The model's tokenizer and context length (capped by model.max_model_len), read
    from the model's files without building it or reading its weights: what rendering
    needs. (The engine is loaded only for a config that leaves the context length to its
    model family's default.)"""
    from engine.loader import open_model_source

    try:
        source = open_model_source(job.model.path)
        tokenizer = source.tokenizer
    except (OSError, ValueError, RuntimeError) as exc:
        raise JobError(f"model.path: {exc}") from None
    if tokenizer is None:
        raise JobError(
            f"model.path: {job.model.path} has no tokenizer, so text prompts cannot be "
            "rendered; use a model directory with tokenizer files"
        )
    context = source.declared_context
    if context is None:
        from batchgen.job_engine import load_llm  # builds the engine: torch, the model

        context = load_llm(job).max_model_len
    if job.model.max_model_len is not None:
        context = min(context, job.model.max_model_len)
    return tokenizer, context


def open_job(job: JobSpec, check_ids: bool = True) -> JobContext:
    """Check the job against its input and model without running anything. check_ids
    False (`batchgen render`, which reads a few rows) skips the passes over the whole
    input: ids and UTF-8 (a bad value among the rows read is still refused by name)."""
    file_format = detect_format(job.input)
    if file_format in BATCH_FILE_FORMATS:
        return _open_batch_file(job, file_format, check_ids)
    if job.prompt is None:
        raise JobError(
            "missing key 'prompt': a Parquet input needs a prompt section (a template, or "
            "chat rows in a messages column)"
        )
    source = ParquetInput(job.input)
    names = source.schema.names
    used = set()
    if job.prompt.template is not None:
        used = template_columns(job.prompt.template)
        missing = sorted(used - set(names))
        if missing:
            raise JobError(
                f"prompt.template: refers to column(s) {missing} that the input does not have "
                f"(columns: {names})"
            )
    elif job.prompt.messages_column not in names:
        raise JobError(
            f"prompt.messages: no column '{job.prompt.messages_column}' in the input for chat "
            f"rows (columns: {names}); give prompt.template, or the column of messages"
        )
    else:
        used = {job.prompt.messages_column}
    for param, column in (job.sampling.from_columns or {}).items():
        if column not in names:
            raise JobError(
                f"sampling.from_columns.{param}: column '{column}' not found in the input "
                f"(columns: {names})"
            )
        used.add(column)
    needed = sorted(used)
    if cluster_mode(job.batching) == "column":
        if job.batching.cluster not in names:
            raise JobError(
                f"batching.cluster: '{job.batching.cluster}' is not auto, off, or an input "
                f"column (columns: {names})"
            )
        needed.append(job.batching.cluster)
    source.add_columns(needed)
    carry_inputs = source.value_columns()
    if job.output.carry_columns is not None:
        for col in job.output.carry_columns:
            if col not in names:
                raise JobError(
                    f"output.carry_columns: column '{col}' not found in the input ({names})"
                )
        carry_inputs = [c for c in job.output.carry_columns if c != source.id_source]
        source.add_columns(carry_inputs)
    carry_map = {c: output_column_for(c) for c in carry_inputs}
    carry_fields = [pa.field(out, source.schema.field(col).type) for col, out in carry_map.items()]
    check_model_path(job.model.path)
    source.check_types()
    if check_ids:
        source.check_text()
    total = source.check_ids() if check_ids else source.count_rows()
    return JobContext(
        job=job,
        input=source,
        carry_map=carry_map,
        schema=result_schema(carry_fields, source.id_type),
        total_rows=total,
    )


def _open_batch_file(job: JobSpec, file_format: str, check_ids: bool) -> JobContext:
    """A request file: the requests carry their messages and parameters, so the job has
    no prompt or per-column settings; custom_id is the row id."""
    refused = [
        (job.prompt is not None, "prompt", "the requests carry their own messages"),
        (
            job.sampling.from_columns is not None,
            "sampling.from_columns",
            "the requests carry their own parameters",
        ),
        (
            cluster_mode(job.batching) == "column",
            "batching.cluster",
            "a request file has no columns to cluster by (use auto or off)",
        ),
        (
            job.output.carry_columns is not None,
            "output.carry_columns",
            "a request's results carry its model and endpoint",
        ),
    ]
    for is_set, key, why in refused:
        if is_set:
            raise JobError(f"{key}: not used with input.format {file_format}: {why}; remove it")
    source = BatchFileInput(job.input, file_format)
    carry_map = {c: output_column_for(c) for c in source.value_columns()}
    carry_fields = [pa.field(out, source.schema.field(col).type) for col, out in carry_map.items()]
    check_model_path(job.model.path)
    total = source.check_ids() if check_ids else source.count_rows()
    return JobContext(
        job=job,
        input=source,
        carry_map=carry_map,
        schema=result_schema(carry_fields, source.id_type),
        total_rows=total,
        format=file_format,
    )
