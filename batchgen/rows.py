"""The typed records that flow through the pipeline, one stage to the next.

InputRow    -> read from Parquet: position, id, the columns read
PreparedRow -> rendered and tokenized (or carrying the reason it cannot run)
ResultRow   -> one output row per (id, n_index), ok or error
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class InputRow:
    seq: int  # position in the input, 0-based, across all files
    # The id as text: one kind of key for sets, seeds and messages whatever the id
    # column's type; the results' id column gets the input's type back (writer.typed_ids).
    id: str
    values: dict[str, Any]


@dataclass(slots=True)
class RowError:
    """Why a row cannot run or failed. `type` is a short stable label for the report."""

    type: str
    message: str


@dataclass(slots=True)
class PreparedRow:
    seq: int
    id: str
    carry: dict[str, Any]
    prompt_token_ids: list[int] = field(default_factory=list)
    error: RowError | None = None
    truncated: bool = False
    group: int | None = None  # cluster id, handed to the engine as Request.group
    # The row's own sampling parameters (batchgen.row_sampling.RowSampling); None: the job's.
    sampling: Any = None

    def num_completions(self, job_n: int) -> int:
        return job_n if self.sampling is None else self.sampling.n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class ResultRow:
    id: str
    n_index: int
    status: str  # "ok" | "error"
    text: str | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cluster_id: int | None
    error: str | None
    error_type: str | None
    seed: int | None
    carry: dict[str, Any]
    seq: int = 0  # input position: used for `order: input`, not written
    cached_prompt_tokens: int = 0  # prompt tokens read from the engine's prefix cache
    # writer.LOGPROB_STRUCT dicts, one per generated token (None: not requested)
    logprobs: list[dict] | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"
