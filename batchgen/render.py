"""Prompt rendering: the job's Jinja2 template over a row, the system prompt, the model's chat
template, tokenization, and the overflow policy against the model's context.

Row values are data, never template code or special tokens:
- the template runs in a sandbox with limits (batchgen/template_sandbox.py) and values are
  passed in as data: a value holding `{{ 7*7 }}` is inserted as those characters;
- a value holding a special-token string (`<|im_end|>`) reaches the model as the ordinary
  tokens of that text; only the job template, the system prompt and the chat template
  put real special tokens in a prompt (batchgen/prompt_data.py marks where values land).

A template that fails on a row, or passes a limit (a rendered prompt longer than
CHARS_PER_CONTEXT_TOKEN characters per token of context beyond the row's own text, a huge
range or loop), makes that row an error row (render_error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from jinja2 import TemplateError, TemplateSyntaxError, meta
from jinja2.exceptions import SecurityError, UndefinedError

from batchgen.job_spec import JobError, PromptSpec, cut
from batchgen.prompt_data import (
    DataMarkingSandbox,
    MarkedText,
    RowMarks,
    reserved_marks,
    special_token_pattern,
)
from batchgen.rows import InputRow, PreparedRow, RowError
from batchgen.template_sandbox import LimitedSandbox

ELLIPSIS = " … "
# Re-rendering after a cut can change token boundaries by a few tokens; cut this many extra
# per retry so truncation converges in a couple of rounds.
_TRUNCATION_SLACK = 8
# A rendered prompt may hold the row's own text plus this many characters per token of
# the model's context (a token is ~4 characters of English; the rest is headroom), so an
# overflow policy still sees whole long documents but no template builds megabytes.
CHARS_PER_CONTEXT_TOKEN = 8
# The cap where no model context is known (the template text task clustering embeds).
DEFAULT_MAX_CHARS = 1 << 20


class TokenizerLike(Protocol):
    has_chat_template: bool
    special_tokens: list[str]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def encode_with_data(
        self, text: str, data_spans: list[tuple[int, int]], add_special_tokens: bool = True
    ) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> str: ...


def template_columns(template: str) -> set[str]:
    """The column names a template refers to (refusing templates that do not parse)."""
    try:
        ast = LimitedSandbox(DEFAULT_MAX_CHARS).parse(template)
    except TemplateSyntaxError as exc:
        raise JobError(f"prompt.template: not a valid Jinja2 template: {exc}") from None
    return set(meta.find_undeclared_variables(ast))


class _RowTemplateFailure(Exception):
    """The job template raised on a row; the message names the exception."""


def _row_chars(values: dict[str, Any]) -> int:
    return sum(len(v) for v in values.values() if isinstance(v, str))


def template_text(template: str) -> Callable[[dict[str, Any]], str]:
    """The job template alone over a row's values, in the same sandbox and limits: the
    user message without system prompt, chat template or tokenizer. Task clustering
    embeds this text. A row the template fails on raises UndefinedError, SecurityError
    (a sandbox refusal or limit) or ValueError (anything else the template raised)."""
    env = LimitedSandbox(DEFAULT_MAX_CHARS)
    compiled = env.compile_limited(template)

    def render(values: dict[str, Any]) -> str:
        try:
            return env.render_limited(compiled, values, DEFAULT_MAX_CHARS + _row_chars(values))
        except (UndefinedError, SecurityError):
            raise
        except Exception as exc:  # user code: any failure is the row's, as a ValueError
            raise ValueError(f"{type(exc).__name__}: {cut(str(exc))}") from None

    return render


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
        self.env = DataMarkingSandbox(CHARS_PER_CONTEXT_TOKEN * max_model_len)
        try:
            self.template = self.env.compile_limited(spec.template)
        except TemplateSyntaxError as exc:
            raise JobError(f"prompt.template: not a valid Jinja2 template: {exc}") from None
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
        self._specials = special_token_pattern(tokenizer.special_tokens)
        self._reserved = reserved_marks(
            spec.template, spec.system, getattr(tokenizer, "chat_template", None)
        )

    def max_chars(self, values: dict[str, Any]) -> int:
        """The longest text the template may render for a row with these values."""
        return CHARS_PER_CONTEXT_TOKEN * self.max_model_len + _row_chars(values)

    def render_text(self, values: dict[str, Any]) -> str:
        """The user message: the job template over the row's values."""
        return self._render(values)[0].plain

    def full_prompt(self, user: str) -> str:
        """The text the model sees for a user message, with the system prompt and chat
        template applied."""
        marks = RowMarks(self._specials, set(self._reserved))
        return self._full(MarkedText(user), marks).plain

    def tokenize(self, user: str) -> list[int]:
        """The prompt token ids for a user message taken as the template's own text."""
        marks = RowMarks(self._specials, set(self._reserved))
        return self._tokens(MarkedText(user), marks)

    def prepare(self, row: InputRow, max_tokens: int | None = None) -> PreparedRow:
        """`max_tokens`: the row's own (a per-row parameter), when not the job's."""
        carry = {out: row.values.get(col) for col, out in self.carry_columns.items()}
        prepared = PreparedRow(seq=row.seq, id=row.id, carry=carry)
        budget = self.prompt_budget if max_tokens is None else self.max_model_len - max_tokens
        try:
            self._fill(prepared, row.values, budget, max_tokens or self.max_tokens)
        except _RowTemplateFailure as exc:
            prepared.error = RowError("render_error", str(exc))
        except (TemplateError, TypeError, ValueError) as exc:  # the chat template's
            prepared.error = RowError("render_error", f"{type(exc).__name__}: {cut(str(exc))}")
        return prepared

    def _render(self, values: dict[str, Any]) -> tuple[MarkedText, RowMarks]:
        """The job template over the row, its values marked as data. Any exception the
        template raises (a limit, a division by zero, runaway recursion) is the row's."""
        marks = RowMarks.for_row(values, self._specials, self._reserved)
        wrapped = {k: marks.wrap(v) for k, v in values.items()}
        try:
            text = self.env.render_limited(self.template, wrapped, self.max_chars(values))
        except Exception as exc:  # the template is user code: any failure is this row's
            raise _RowTemplateFailure(f"{type(exc).__name__}: {cut(str(exc))}") from None
        return marks.unmark(text), marks

    def _full(self, user: MarkedText, marks: RowMarks) -> MarkedText:
        """The prompt text with the system prompt and chat template applied."""
        if self.chat:
            messages = []
            if self.spec.system:
                messages.append({"role": "system", "content": self.spec.system})
            messages.append({"role": "user", "content": marks.mark(user)})
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return marks.unmark(text)
        if self.spec.system:
            return MarkedText(f"{self.spec.system}\n\n") + user
        return user

    def _tokens(self, user: MarkedText, marks: RowMarks) -> list[int]:
        full = self._full(user, marks)
        # A chat-rendered prompt already holds its special tokens (BOS, role markers).
        return self.tokenizer.encode_with_data(
            full.plain, full.spans, add_special_tokens=not self.chat
        )

    def _fill(
        self, prepared: PreparedRow, values: dict[str, Any], budget: int, max_tokens: int
    ) -> None:
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
        user, marks = self._render(values)
        if not user.plain.strip():
            prepared.error = RowError("empty_prompt", "the rendered prompt is empty or blank")
            return
        ids = self._tokens(user, marks)
        if len(ids) > budget:
            if self.spec.overflow == "error" or budget < 1:
                prepared.error = RowError(
                    "prompt_too_long",
                    f"prompt has {len(ids)} tokens; at most {max(budget, 0)} fit "
                    f"(context {self.max_model_len} minus max_tokens {max_tokens}); "
                    "set prompt.overflow to truncate_left or truncate_middle to cut it",
                )
                return
            ids = self._truncate(user, marks, len(ids), budget)
            if ids is None:
                prepared.error = RowError(
                    "prompt_too_long",
                    f"the system prompt and template alone exceed the {budget} "
                    "prompt tokens available",
                )
                return
            prepared.truncated = True
        prepared.prompt_token_ids = ids

    def _truncate(
        self, user: MarkedText, marks: RowMarks, full_len: int, budget: int
    ) -> list[int] | None:
        """Cut the user message (never the chat template around it) until the prompt fits.
        truncate_left keeps the end of the message; truncate_middle keeps both ends."""
        content = self.tokenizer.encode_with_data(user.plain, user.spans, add_special_tokens=False)
        end = len(user.plain)
        excess = full_len - budget
        for _ in range(6):
            keep = len(content) - excess - _TRUNCATION_SLACK
            if keep <= 0:
                return None
            if self.spec.overflow == "truncate_left":
                cut_text = user.slice(self._tail_start(content, keep, user.plain), end)
            else:
                head = keep // 2
                tail = keep - head
                cut_text = (
                    user.slice(0, self._head_end(content, head, user.plain))
                    + MarkedText(ELLIPSIS)
                    + user.slice(self._tail_start(content, tail, user.plain), end)
                )
            ids = self._tokens(cut_text, marks)
            if len(ids) <= budget:
                return ids
            excess += len(ids) - budget
        return None

    def _head_end(self, content: list[int], count: int, plain: str) -> int:
        """Where in `plain` the text of its first `count` tokens ends."""
        head = self.tokenizer.decode(content[:count], skip_special_tokens=False)
        if plain.startswith(head):
            return len(head)
        n = 0
        for a, b in zip(head, plain):  # a token cut inside a character decodes to U+FFFD
            if a != b:
                break
            n += 1
        return n

    def _tail_start(self, content: list[int], count: int, plain: str) -> int:
        """Where in `plain` the text of its last `count` tokens starts."""
        tail = self.tokenizer.decode(content[len(content) - count :], skip_special_tokens=False)
        if plain.endswith(tail):
            return len(plain) - len(tail)
        n = 0
        for a, b in zip(reversed(tail), reversed(plain)):
            if a != b:
                break
            n += 1
        return len(plain) - n
