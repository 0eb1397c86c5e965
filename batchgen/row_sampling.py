"""One row's sampling parameters: the job's `sampling` section, with what the row itself
sets (a request body's parameters, a Parquet column named in `sampling.from_columns`)
put over it. The row's requests to the engine are made from this."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from batchgen.job_spec import SamplingSpec


@dataclass(frozen=True, slots=True)
class RowSampling:
    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    stop: tuple[str, ...]
    seed: int  # the row's base seed: each completion's seed is derived from it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the top k
    response_format: dict | None = None  # OpenAI's shape, or {"type": "regex" | "choice"}
    json_whitespace: bool = False  # job-level only: JSON grammars allow free whitespace

    @classmethod
    def from_job(cls, spec: SamplingSpec) -> RowSampling:
        """The job's parameters."""
        return cls(
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k,
            min_p=spec.min_p,
            max_tokens=spec.max_tokens,
            stop=tuple(spec.stop or ()),
            seed=spec.seed,
            presence_penalty=spec.presence_penalty,
            frequency_penalty=spec.frequency_penalty,
            logprobs=spec.engine_logprobs,
            response_format=spec.response_format,
            json_whitespace=spec.json_whitespace,
        )

    def replace(self, **changes: Any) -> RowSampling:
        return dataclasses.replace(self, **changes)

    def engine_params(self, seed: int):
        """The engine's SamplingParams of one completion (n=1: the feed sends a row's n
        completions as n requests, each with its own derived seed)."""
        from engine import SamplingParams

        return SamplingParams(
            n=1,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            max_tokens=self.max_tokens,
            stop=list(self.stop),
            seed=seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logprobs=self.logprobs,
            response_format=self.response_format,
            json_whitespace=self.json_whitespace,
        )
