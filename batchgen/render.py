"""Prompt rendering: the job's Jinja2 template over a row, the system prompt, the model's chat
template, tokenization, and the overflow policy against the model's context.

The template runs in Jinja2's sandbox and row values are passed in as data: a value holding
`{{ 7*7 }}` is inserted as those characters and never evaluated."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from jinja2 import StrictUndefined, TemplateSyntaxError, meta
from jinja2.exceptions import SecurityError, UndefinedError
from jinja2.sandbox import SandboxedEnvironment

from batchgen.job_spec import JobError, PromptSpec
from batchgen.rows import InputRow, PreparedRow, RowError

ELLIPSIS = " … "
# Re-rendering after a cut can change token boundaries by a few tokens; cut this many extra
# per retry so truncation converges in a couple of rounds.
_TRUNCATION_SLACK = 8


class TokenizerLike(Protocol):
    has_chat_template: bool

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> str: ...


def _environment() -> SandboxedEnvironment:
    return SandboxedEnvironment(
        undefined=StrictUndefined, autoescape=False, keep_trailing_newline=True
    )


def template_columns(template: str) -> set[str]:
    """The column names a template refers to (refusing templates that do not parse)."""
    try:
        ast = _environment().parse(template)
    except TemplateSyntaxError as exc:
        raise JobError(f"prompt.template: not a valid Jinja2 template: {exc}") from None
    return set(meta.find_undeclared_variables(ast))


def template_text(template: str) -> Callable[[dict[str, Any]], str]:
    """The job template alone over a row's values, in the same sandbox: the user message
    without system prompt, chat template or tokenizer. Task clustering embeds this text."""
    compiled = _environment().from_string(template)
    return lambda values: compiled.render(**values)


class PromptRenderer:
    """Turns an InputRow into a PreparedRow: prompt token ids, or the error that stops it."""

    def __init__(
        self,
        spec: PromptSpec,
        tokenizer: TokenizerLike,
        max_model_len: int,
        max_tokens: int,
        carry_columns: dict[str, str],
    ):
        self.spec = spec
        self.tokenizer = tokenizer
        self.template = _environment().from_string(spec.template)
        self.columns = sorted(template_columns(spec.template))
        if spec.chat and not tokenizer.has_chat_template:
            raise JobError("prompt.chat: true, but the model's tokenizer has no chat template")
        self.chat = tokenizer.has_chat_template if spec.chat is None else spec.chat
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.prompt_budget = max_model_len - max_tokens
        if self.prompt_budget < 1:
            raise JobError(
                f"sampling.max_tokens: {max_tokens} leaves no room for a prompt in the model's "
                f"context of {max_model_len} tokens"
            )
        self.carry_columns = carry_columns  # input column -> output column

    def render_text(self, values: dict[str, Any]) -> str:
        """The user message: the job template over the row's values."""
        return self.template.render(**values)

    def full_prompt(self, user: str) -> str:
        """The text the model sees, with the system prompt and chat template applied."""
        if self.chat:
            messages = []
            if self.spec.system:
                messages.append({"role": "system", "content": self.spec.system})
            messages.append({"role": "user", "content": user})
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if self.spec.system:
            return f"{self.spec.system}\n\n{user}"
        return user

    def tokenize(self, user: str) -> list[int]:
        # A chat-rendered prompt already holds its special tokens (BOS, role markers).
        return self.tokenizer.encode(self.full_prompt(user), add_special_tokens=not self.chat)

    def prepare(self, row: InputRow) -> PreparedRow:
        carry = {out: row.values.get(col) for col, out in self.carry_columns.items()}
        prepared = PreparedRow(seq=row.seq, id=row.id, carry=carry)
        try:
            self._fill(prepared, row.values)
        except (UndefinedError, SecurityError, TypeError, ValueError) as exc:
            prepared.error = RowError("render_error", f"{type(exc).__name__}: {exc}")
        return prepared

    def _fill(self, prepared: PreparedRow, values: dict[str, Any]) -> None:
        nulls = [c for c in self.columns if values.get(c) is None]
        if nulls:
            prepared.error = RowError("null_input", f"null value in column(s) {nulls}")
            return
        # A row whose template columns are all blank has nothing to ask, even if the
        # template around them has words.
        used = [values[c] for c in self.columns]
        if used and all(isinstance(v, str) and not v.strip() for v in used):
            prepared.error = RowError(
                "empty_prompt", f"column(s) {self.columns} are empty or blank"
            )
            return
        user = self.render_text(values)
        if not user.strip():
            prepared.error = RowError("empty_prompt", "the rendered prompt is empty or blank")
            return
        ids = self.tokenize(user)
        if len(ids) > self.prompt_budget:
            if self.spec.overflow == "error":
                prepared.error = RowError(
                    "prompt_too_long",
                    f"prompt has {len(ids)} tokens; at most {self.prompt_budget} fit "
                    f"(context {self.max_model_len} minus max_tokens {self.max_tokens}); "
                    "set prompt.overflow to truncate_left or truncate_middle to cut it",
                )
                return
            ids = self._truncate(user, len(ids))
            if ids is None:
                prepared.error = RowError(
                    "prompt_too_long",
                    f"the system prompt and template alone exceed the {self.prompt_budget} "
                    "prompt tokens available",
                )
                return
            prepared.truncated = True
        prepared.prompt_token_ids = ids

    def _truncate(self, user: str, full_len: int) -> list[int] | None:
        """Cut the user message (never the chat template around it) until the prompt fits.
        truncate_left keeps the end of the message; truncate_middle keeps both ends."""
        content = self.tokenizer.encode(user, add_special_tokens=False)
        excess = full_len - self.prompt_budget
        for _ in range(6):
            keep = len(content) - excess - _TRUNCATION_SLACK
            if keep <= 0:
                return None
            if self.spec.overflow == "truncate_left":
                text = self.tokenizer.decode(content[len(content) - keep :])
            else:
                head = keep // 2
                tail = keep - head
                text = (
                    self.tokenizer.decode(content[:head])
                    + ELLIPSIS
                    + self.tokenizer.decode(content[len(content) - tail :])
                )
            ids = self.tokenize(text)
            if len(ids) <= self.prompt_budget:
                return ids
            excess += len(ids) - self.prompt_budget
        return None
