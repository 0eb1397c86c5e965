"""InputRow -> PreparedRow for every kind of input row: a template row (the job's prompt
template, batchgen/render.py), a chat row (a Parquet `messages` column), or a request of
a batch file (OpenAI or Anthropic JSONL). Each row's sampling parameters are resolved
here too: the job's, with what the row sets over them (a request's body, the columns
named in `sampling.from_columns`); a wrong value makes the row an error row that names
the key."""

from __future__ import annotations

from collections.abc import Callable

from jinja2 import TemplateError

from batchgen.batch_api.anthropic_request import parse_anthropic_line
from batchgen.batch_api.batch_request import CHAT, BatchRequest
from batchgen.batch_api.jsonl_input import REQUEST
from batchgen.batch_api.openai_request import parse_openai_line
from batchgen.batch_api.request_params import RequestError, resolve
from batchgen.chat_render import ConversationRenderer
from batchgen.conversation import (
    OPENAI_ROLES,
    conversation_text,
    parse_messages,
    without_nulls,
)
from batchgen.job_spec import BATCH_FILE_FORMATS, JobError, JobSpec, cut
from batchgen.render import PromptRenderer
from batchgen.row_sampling import RowSampling
from batchgen.rows import InputRow, PreparedRow, RowError

PARSERS: dict[str, Callable[[dict], BatchRequest]] = {
    "openai_batch": parse_openai_line,
    "anthropic_batch": parse_anthropic_line,
}


class RowPreparer:
    """Prepares the rows of one job (`input_format` as opened by open_job)."""

    def __init__(
        self,
        job: JobSpec,
        tokenizer,
        max_model_len: int,
        carry_map: dict[str, str],
        input_format: str,
    ):
        self.job = job
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.carry_map = carry_map
        self.base = RowSampling.from_job(job.sampling)
        self.from_columns = dict(job.sampling.from_columns or {})
        self.template: PromptRenderer | None = None
        self.parse = PARSERS.get(input_format)
        self.messages_column = None
        if self.parse is None:
            if job.prompt.messages_column is None:
                self.template = PromptRenderer(
                    job.prompt, tokenizer, max_model_len, job.sampling.max_tokens, carry_map
                )
            else:
                self.messages_column = job.prompt.messages_column
                if not tokenizer.has_chat_template:
                    raise JobError(
                        f"prompt.messages: chat rows need a chat template, and the tokenizer of "
                        f"{job.model.path} has none"
                    )
                if job.sampling.max_tokens >= max_model_len:
                    raise JobError(
                        f"sampling.max_tokens: {job.sampling.max_tokens} leaves no room for a "
                        f"prompt in the model's context of {max_model_len} tokens"
                    )
        system = job.prompt.system if job.prompt is not None else None
        self.chat = ConversationRenderer(tokenizer, system)

    def prepare(self, row: InputRow) -> PreparedRow:
        carry = {out: row.values.get(col) for col, out in self.carry_map.items()}
        prepared = PreparedRow(seq=row.seq, id=row.id, carry=carry)
        try:
            if self.parse is not None:
                request = self.parse(row.values[REQUEST])
                sampling = resolve(self.base, request.params)
                self._fill(prepared, request, sampling)
                return prepared
            sampling = resolve(self.base, self._column_params(row))
            if self.template is not None:
                prepared = self.template.prepare(
                    row,
                    None if sampling.max_tokens == self.base.max_tokens else sampling.max_tokens,
                )
                prepared.sampling = None if sampling == self.base else sampling
                return prepared
            self._fill(prepared, self._chat_row(row), sampling)
        except RequestError as exc:
            prepared.error = RowError(exc.error_type, str(exc))
        except (TemplateError, TypeError, ValueError) as exc:  # the chat template's
            prepared.error = RowError("render_error", f"{type(exc).__name__}: {cut(str(exc))}")
        return prepared

    def _column_params(self, row: InputRow) -> list:
        return [
            (param, row.values.get(column), f"column '{column}' ({param})")
            for param, column in self.from_columns.items()
        ]

    def _chat_row(self, row: InputRow) -> BatchRequest:
        column = self.messages_column
        value = row.values.get(column)
        if value is None:
            raise RequestError(f"column '{column}'", "null", "null_input")
        messages = parse_messages(f"column '{column}'", without_nulls(value), OPENAI_ROLES)
        return BatchRequest(CHAT, messages=messages)

    def _fill(self, prepared: PreparedRow, request: BatchRequest, sampling: RowSampling) -> None:
        # Set first: a row that fails below still has its n error rows.
        prepared.sampling = None if sampling == self.base else sampling
        if request.endpoint == CHAT:
            if not self.chat.has_chat_template:
                raise RequestError(
                    "messages", "this model's tokenizer has no chat template", "render_error"
                )
            if not any(m.content.strip() for m in request.messages if m.role != "system"):
                raise RequestError("messages", "every message is empty or blank", "empty_prompt")
            ids = self.chat.conversation_ids(request.messages)
        elif isinstance(request.prompt, list):
            vocab = self.tokenizer.vocab_size
            bad = next((t for t in request.prompt if t >= vocab), None)
            if bad is not None:
                raise RequestError(
                    "body.prompt", f"token id {bad} is not below the vocabulary size {vocab}"
                )
            ids = list(request.prompt)
        else:
            if not request.prompt.strip():
                raise RequestError("body.prompt", "empty or blank", "empty_prompt")
            ids = self.chat.completion_ids(request.prompt)
        budget = self.max_model_len - sampling.max_tokens
        if len(ids) > budget:
            raise RequestError(
                "max_tokens",
                f"prompt has {len(ids)} tokens and max_tokens is {sampling.max_tokens}: together "
                f"over the model's context of {self.max_model_len} tokens",
                "prompt_too_long",
            )
        prepared.prompt_token_ids = ids


def chat_row_text(job: JobSpec, row: InputRow) -> str | None:
    """The text of a chat row or request for embedding (task clustering); None when the
    row is not a valid one (it becomes an error row and joins no cluster)."""
    try:
        if REQUEST in row.values:
            line = row.values[REQUEST]
            fmt = job.input.format or ("anthropic_batch" if "params" in line else "openai_batch")
            request = PARSERS[fmt](line)
            if request.messages is None:
                return request.prompt if isinstance(request.prompt, str) else None
            return conversation_text(request.messages)
        value = row.values.get(job.prompt.messages_column)
        if value is None:
            return None
        return conversation_text(parse_messages("messages", without_nulls(value), OPENAI_ROLES))
    except RequestError:
        return None


def is_batch_file(input_format: str) -> bool:
    return input_format in BATCH_FILE_FORMATS
