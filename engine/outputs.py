"""What the engine returns for a request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TopLogprob:
    """One of the most likely tokens at a position: `token` its text, `bytes` its raw
    bytes (a token may hold part of a UTF-8 character), `logprob` natural log."""

    token_id: int
    token: str
    bytes: bytes
    logprob: float


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the raw distribution (the model's logits
    at temperature 1, before penalties, filters and the grammar mask) and the k most
    likely tokens at its position, most likely first."""

    token_id: int
    token: str
    bytes: bytes
    logprob: float
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class CompletionOutput:
    """One of the n completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # prompt tokens this completion read from the prefix cache instead of computing
    cached_prompt_tokens: int = 0
    # one per token of token_ids when SamplingParams.logprobs is set, else None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """The result of one request. `error` is set (and `outputs` empty) when the engine
    rejected this request alone, e.g. a prompt longer than the model's context."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    error: str | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cached_prompt_tokens(self) -> int:
        """Prompt tokens read from the prefix cache instead of computed, summed over the
        completions (each prefills the prompt, all but the first usually from the cache)."""
        return sum(c.cached_prompt_tokens for c in self.outputs)


@dataclass
class Request:
    """An input to `LLM.stream`: an id the caller chooses, the prompt as text or token ids,
    and its sampling parameters. `group` is a hint for the scheduler (e.g. a task cluster):
    it prefers to admit requests of the group that dominates the running batch. `tag` is
    the caller's label for the request (batchgen: its row id); the engine only matches it
    against injected `crash@row=ID` faults (engine/fault_injection.py)."""

    request_id: str
    prompt: str | list[int]
    sampling_params: object | None = None
    group: int | None = None
    tag: str | None = None
