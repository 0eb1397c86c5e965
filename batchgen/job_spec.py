"""The job file: YAML validated by pydantic models that forbid unknown keys, so a typo is an
error that names the key. Relative paths are taken from the directory batchgen runs in, as
in the README's `batchgen run jobs/translate.yaml` run from the repository root."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"


class JobError(Exception):
    """A job that cannot run as written (exit code 2). The message names the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputSpec(_Section):
    path: str = Field(description="a Parquet file, a directory of them, or a glob")
    id_column: str | None = Field(None, description="column holding each row's unique id")
    id: Literal["content_hash"] | None = Field(
        None, description="derive a stable id from the row's content instead of a column"
    )
    columns: list[str] | None = Field(None, description="columns to read (default: all)")
    batch_rows: int = Field(4096, ge=1, description="rows per Parquet read batch")

    @model_validator(mode="after")
    def _one_id_source(self) -> InputSpec:
        if self.id_column is not None and self.id is not None:
            raise ValueError("give either input.id_column or input.id: content_hash, not both")
        return self

    @property
    def id_source(self) -> str:
        """The id column name, or "content_hash"."""
        if self.id == "content_hash":
            return "content_hash"
        return self.id_column or "id"


class PromptSpec(_Section):
    template: str = Field(description="Jinja2 template over the row's columns")
    system: str | None = None
    chat: bool | None = Field(
        None, description="apply the model's chat template (default: when the model has one)"
    )
    overflow: Literal["error", "truncate_left", "truncate_middle"] = "error"


class ModelSpec(_Section):
    path: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_memory: int | None = Field(None, ge=1, description="bytes for the KV cache")
    max_model_len: int | None = Field(None, ge=2, description="cap the model's context")
    # Routing statistics for MoE models (distinct experts read per step, per cluster in the
    # report). None: on for MoE models on the CPU, where it costs little; on a GPU it makes
    # decode steps run eagerly instead of replaying CUDA graphs, so it is opt-in there.
    record_routing: bool | None = None


class SamplingSpec(_Section):
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = 0
    min_p: float = Field(0.0, ge=0, le=1)
    max_tokens: int = Field(256, ge=1)
    stop: list[str] | None = None
    seed: int = 0

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data


class BatchingSpec(_Section):
    cluster: str = Field("auto", description="auto | off | a column holding task labels")
    num_clusters: int | None = Field(
        None, ge=1, description="cluster: auto with a fixed number of clusters (default: chosen)"
    )
    embedding_model: str = Field(
        "default", description="sentence-transformers model directory for cluster: auto"
    )
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    plan_window: int = Field(
        512, ge=1, description="rows sorted together by prompt length (bounds memory)"
    )


class OutputSpec(_Section):
    path: str
    rows_per_part: int = Field(1000, ge=1)
    carry_columns: list[str] | None = Field(
        None, description="input columns copied to the results (default: all read columns)"
    )
    order: Literal["any", "input"] = "any"


class ErrorsSpec(_Section):
    budget: float = Field(0.01, ge=0, le=1)


class JobSpec(_Section):
    input: InputSpec
    prompt: PromptSpec
    model: ModelSpec = ModelSpec()
    sampling: SamplingSpec = SamplingSpec()
    batching: BatchingSpec = BatchingSpec()
    output: OutputSpec
    errors: ErrorsSpec = ErrorsSpec()

    def fingerprint_fields(self) -> dict:
        """The fields that change what a row's output is. A run directory made with one
        fingerprint refuses a job with another unless `--new-run`."""
        return {
            "input.id": self.input.id_source,
            "input.columns": self.input.columns,
            "prompt": self.prompt.model_dump(),
            "model.path": self.model.path,
            "model.dtype": self.model.dtype,
            "model.max_model_len": self.model.max_model_len,
            "sampling": self.sampling.model_dump(),
            "output.carry_columns": self.output.carry_columns,
        }

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{where}'")
        elif err["type"] == "missing":
            lines.append(f"missing key '{where}'")
        else:
            lines.append(f"'{where}': {err['msg']}")
    return "; ".join(lines)


def parse_job(data: object, source: str = "job") -> JobSpec:
    """Validate a job given as a dict (already parsed YAML)."""
    if not isinstance(data, dict):
        raise JobError(f"{source}: the job file must be a mapping of sections, got {data!r:.80}")
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise JobError(f"{source}: {_format_validation_error(exc)}") from None


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job file, raising JobError with a message naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise JobError(f"job file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise JobError(f"{path}: not valid YAML: {exc}") from None
    return parse_job(data, source=str(path))
