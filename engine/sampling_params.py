"""Sampling parameters for one request, vLLM-shaped."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to sample the completion(s) of one prompt.

    temperature 0 means greedy. `seed` gives the request its own random generator, so its
    samples do not depend on what else is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    # OpenAI semantics over this completion's generated tokens: logit -= presence * (count
    # > 0) + frequency * count, before the grammar mask and sampling.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: off. k >= 0: each generated token's logprob and its k most likely alternatives,
    # from the raw distribution (the model's logits at temperature 1, before penalties,
    # filters and the grammar mask), as vLLM's default.
    logprobs: int | None = None
    # OpenAI's response_format (json_schema, json_object), plus {"type": "regex", "regex"}
    # and {"type": "choice", "choice": [...]}; None or {"type": "text"}: free text.
    response_format: dict | None = None
    # JSON grammars allow no whitespace between tokens unless this is set (compact JSON).
    json_whitespace: bool = False
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        checks = [
            (self.n >= 1, f"n must be >= 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.logprobs is None
                or (type(self.logprobs) is int and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
                f"logprobs must be None or an integer in [0, {MAX_TOP_LOGPROBS}], "
                f"got {self.logprobs!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        from engine.structured_output.grammar_spec import grammar_spec

        # the shape is checked here; compiling it against the tokenizer is the engine's
        self.grammar = grammar_spec(self.response_format, self.json_whitespace)
        if self.grammar is not None and (self.ignore_eos or self.min_tokens):
            raise ValueError(
                "response_format cannot be combined with ignore_eos or min_tokens: the "
                "grammar ends the output with EOS where it accepts"
            )

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
