"""The job file: YAML validated by pydantic models that forbid unknown keys, so a typo is an
error that names the key, and that take every value in its own type (strict: `max_tokens:
true` or `"4"` is an error, not 1 or 4; a float field still takes an int). Relative paths
are taken from the directory batchgen runs in, as in the README's `batchgen run
jobs/translate.yaml` run from the repository root.

A job file is untrusted input: the YAML loader counts every node as composed, an alias at
the size of what it repeats, and refuses a file past MAX_YAML_NODES (a "billion laughs"
file is a few hundred bytes that expand to billions of nodes); recursive aliases are
refused; no message ever formats more than a short, cut view of a value."""

from __future__ import annotations

import hashlib
import json
import reprlib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_MODEL = "smollm2-135m-instruct"
# A job file is a few dozen keys; these bounds are orders of magnitude above any real one.
MAX_JOB_FILE_BYTES = 1 << 20
MAX_YAML_NODES = 10_000
# How much of a user's value a message shows, and how many problems it lists.
MAX_SHOWN_CHARS = 200
MAX_SHOWN_PROBLEMS = 5


class JobError(Exception):
    """A job that cannot run as written (exit code 2). The message names the problem."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


# Input formats: Parquet rows rendered by the job's prompt, or request files of the
# OpenAI Batch API and Anthropic Message Batches (JSONL, one request per line).
INPUT_FORMATS = ("parquet", "openai_batch", "anthropic_batch")
BATCH_FILE_FORMATS = ("openai_batch", "anthropic_batch")
# The sampling parameters a row may set for itself (a request body, sampling.from_columns).
ROW_PARAMETERS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "stop",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "response_format",
)


class InputSpec(_Section):
    path: str = Field(description="a Parquet file, a directory of them, or a glob")
    format: Literal["parquet", "openai_batch", "anthropic_batch"] | None = Field(
        None, description="default: by the file's extension (.parquet, .jsonl), then content"
    )
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
    template: str | None = Field(
        None, description="Jinja2 template over the row's columns (default: chat rows)"
    )
    messages: str | None = Field(
        None,
        description="column of chat rows (a list of {role, content}); default 'messages' "
        "when there is no template",
    )
    system: str | None = None
    chat: bool | None = Field(
        None, description="apply the model's chat template (default: when the model has one)"
    )
    overflow: Literal["error", "truncate_left", "truncate_middle"] = "error"

    @model_validator(mode="after")
    def _template_or_messages(self) -> PromptSpec:
        if self.template is not None and self.messages is not None:
            raise ValueError("give either prompt.template or prompt.messages, not both")
        if self.template is None and self.chat is False:
            raise ValueError(
                "prompt.chat: false needs a prompt.template (chat rows, from a messages "
                "column, go through the chat template)"
            )
        return self

    @property
    def messages_column(self) -> str | None:
        """The column holding chat rows, or None for a template job."""
        if self.template is not None:
            return None
        return self.messages or "messages"


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
    # Routed experts that do not fit the GPU computed in host RAM by the CPU: off, auto, or
    # a placement file (engine/expert_placement.py). auto keeps the most routed experts on
    # the GPU when expert_routing_stats names a `batchgen bench routing --out` file.
    expert_offload: str = "off"
    expert_routing_stats: str | None = None


class SamplingSpec(_Section):
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = 0
    min_p: float = Field(0.0, ge=0, le=1)
    max_tokens: int = Field(256, ge=1)
    stop: list[str] | None = None
    seed: int = 0
    from_columns: dict[str, str] | None = Field(
        None, description="per-row parameters: {parameter: input column}, e.g. max_tokens: n"
    )

    @model_validator(mode="after")
    def _known_row_parameters(self) -> SamplingSpec:
        unknown = sorted(set(self.from_columns or {}) - set(ROW_PARAMETERS))
        if unknown:
            raise ValueError(
                f"sampling.from_columns: unknown parameter(s) {unknown}; known: "
                f"{', '.join(ROW_PARAMETERS)}"
            )
        return self

    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logprobs: bool = Field(False, description="each generated token's logprob in the results")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="with logprobs: the k most likely tokens at each position"
    )
    response_format: dict | None = Field(
        None, description="OpenAI response_format (json_schema, json_object), regex or choice"
    )
    json_whitespace: bool = Field(False, description="JSON grammars allow free whitespace")

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data: object) -> object:
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _check_structured(self) -> SamplingSpec:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("sampling.top_logprobs needs sampling.logprobs: true")
        from engine.structured_output import grammar_spec

        grammar_spec(self.response_format, self.json_whitespace)  # ValueError naming the key
        return self

    @property
    def engine_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None off, else the number of top alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None


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
    batch_invariant: bool = Field(
        True, description="a row's output independent of its batch (CPU); false: faster"
    )
    prefix_caching: bool = Field(
        True,
        description="rows sharing a prompt prefix compute it once (the same outputs either way)",
    )

    @field_validator("cluster", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        # YAML 1.1 reads an unquoted `off` as false (and `on`, `yes` as true)
        if value is False:
            return "off"
        if value is True:
            raise ValueError(
                "batching.cluster: true; write auto, off or a column name (YAML reads an "
                "unquoted on or yes as true)"
            )
        return value


class OutputSpec(_Section):
    path: str
    rows_per_part: int = Field(1000, ge=1)
    carry_columns: list[str] | None = Field(
        None, description="input columns copied to the results (default: all read columns)"
    )
    order: Literal["any", "input"] = "any"
    export: Literal["openai_batch", "anthropic_batch"] | None = Field(
        None, description="also write the results as batch-API files (<path>/export/)"
    )


class ErrorsSpec(_Section):
    budget: float = Field(0.01, ge=0, le=1)


class ExecutorSpec(_Section):
    """Where the job runs. Not part of the fingerprint: a row's output is the same on
    either executor, so a run started locally may be resumed on a Ray cluster."""

    type: Literal["local", "ray"] = "local"
    address: str | None = Field(
        None,
        description="ray: auto | ray://host:port | local; default: a running cluster, else a "
        "new local one",
    )
    num_workers: int = Field(1, ge=1, description="ray: engines (actors), one per GPU or slot")
    resources_per_worker: dict[str, float] | None = Field(
        None, description="ray: e.g. {GPU: 1} or {CPU: 4}; default {CPU: 1}"
    )

    @model_validator(mode="after")
    def _ray_keys_only_for_ray(self) -> ExecutorSpec:
        if self.type == "local" and (
            self.address is not None
            or self.num_workers != 1
            or self.resources_per_worker is not None
        ):
            raise ValueError("address, num_workers and resources_per_worker need type: ray")
        for name, amount in (self.resources_per_worker or {}).items():
            if not amount > 0:
                raise ValueError(f"resources_per_worker.{name} must be > 0 (got {amount})")
        return self


class JobSpec(_Section):
    input: InputSpec
    prompt: PromptSpec | None = None
    model: ModelSpec = ModelSpec()
    sampling: SamplingSpec = SamplingSpec()
    batching: BatchingSpec = BatchingSpec()
    output: OutputSpec
    errors: ErrorsSpec = ErrorsSpec()
    executor: ExecutorSpec = ExecutorSpec()

    @model_validator(mode="after")
    def _prompt_for_parquet(self) -> JobSpec:
        # A request file carries its own messages; Parquet rows need the job to say how
        # they become prompts. (A path whose format only its content tells is checked
        # again when the input is opened.)
        maybe_jsonl = self.input.path.lower().endswith((".jsonl", ".json"))
        if self.prompt is None and self.input.format not in BATCH_FILE_FORMATS and not maybe_jsonl:
            raise ValueError(
                "missing key 'prompt': a Parquet input needs a prompt section (a template, "
                "or chat rows in a messages column); only OpenAI or Anthropic batch "
                "files (input.format) carry their own"
            )
        return self

    def fingerprint_fields(self) -> dict:
        """The fields that change what a row's output is. A run directory made with one
        fingerprint refuses a job with another unless `--new-run`. Fields added since
        the first run directories were written enter only when set, so those runs keep
        their fingerprint."""
        prompt = None
        if self.prompt is not None:
            prompt = self.prompt.model_dump()
            if prompt["messages"] is None:
                del prompt["messages"]
        sampling = self.sampling.model_dump()
        if sampling["from_columns"] is None:
            del sampling["from_columns"]
        return {
            "input.id": self.input.id_source,
            "input.columns": self.input.columns,
            **({"input.format": self.input.format} if self.input.format else {}),
            "prompt": prompt,
            "model.path": self.model.path,
            "model.dtype": self.model.dtype,
            "model.max_model_len": self.model.max_model_len,
            "sampling": sampling,
            "output.carry_columns": self.output.carry_columns,
            # only when off, so that jobs from before the switch keep their fingerprint
            **({} if self.batching.batch_invariant else {"batching.batch_invariant": False}),
        }

    @property
    def fingerprint(self) -> str:
        blob = json.dumps(self.fingerprint_fields(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 4, 4
_SHORT.maxstring = _SHORT.maxother = 60


def short_repr(value: object) -> str:
    """A bounded view of any value for a message: reprlib never walks more than a few
    items per level, so a shared-reference structure of billions of items costs nothing."""
    return cut(_SHORT.repr(value))


def cut(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    errors = exc.errors()
    for err in errors[:MAX_SHOWN_PROBLEMS]:
        where = ".".join(str(part) for part in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown key '{where}'")
        elif err["type"] == "missing":
            lines.append(f"missing key '{where}'")
        elif err["type"] == "value_error":  # a check across keys: its message names them
            lines.append(cut(str(err["ctx"]["error"]), 500))
        else:
            got = err.get("input")
            lines.append(
                f"'{where}': {cut(err['msg'])} (got {type(got).__name__} {short_repr(got)})"
            )
    if len(errors) > MAX_SHOWN_PROBLEMS:
        lines.append(f"and {len(errors) - MAX_SHOWN_PROBLEMS} more problems")
    return "; ".join(lines)


def parse_job(data: object, source: str = "job") -> JobSpec:
    """Validate a job given as a dict (already parsed YAML)."""
    if not isinstance(data, dict):
        raise JobError(
            f"{source}: the job file must be a mapping of sections, got "
            f"{type(data).__name__} {short_repr(data)}"
        )
    try:
        return JobSpec.model_validate(data)
    except ValidationError as exc:
        raise JobError(f"{source}: {_format_validation_error(exc)}") from None


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts the nodes a document expands to (an alias counts as the
    whole subtree it repeats) and stops past MAX_YAML_NODES, before anything is built
    from them. Aliases are allowed within that bound; an alias to a node that is still
    being composed (a recursive structure) is refused."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.expanded_nodes = 0
        self._subtree_nodes: dict[int, int] = {}  # id(node) -> expanded nodes under it

    def _count(self, nodes: int, mark) -> None:
        self.expanded_nodes += nodes
        if self.expanded_nodes > MAX_YAML_NODES:
            raise yaml.composer.ComposerError(
                None,
                None,
                f"the document expands to more than {MAX_YAML_NODES:,} YAML nodes (aliases "
                "counted at the size of what they repeat); a job file needs far fewer",
                mark,
            )

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            target = self.anchors.get(event.anchor)
            if target is not None:  # an unknown anchor: the composer names it
                size = self._subtree_nodes.get(id(target))
                if size is None:
                    raise yaml.composer.ComposerError(
                        None,
                        None,
                        f"alias *{cut(event.anchor, 60)} refers to a node that contains it "
                        "(a recursive structure)",
                        event.start_mark,
                    )
                self._count(size, event.start_mark)
            return super().compose_node(parent, index)
        before = self.expanded_nodes
        self._count(1, self.peek_event().start_mark)
        node = super().compose_node(parent, index)
        self._subtree_nodes[id(node)] = self.expanded_nodes - before
        return node


def load_yaml(text: str) -> object:
    """One YAML document, safely and within MAX_YAML_NODES (raises yaml.YAMLError)."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_job(path: str | Path) -> JobSpec:
    """Read and validate a job file, raising JobError with a message naming the problem."""
    path = Path(path)
    if not path.is_file():
        raise JobError(f"job file not found: {path}")
    size = path.stat().st_size
    if size > MAX_JOB_FILE_BYTES:
        raise JobError(
            f"{path}: {size:,} bytes; a job file is at most {MAX_JOB_FILE_BYTES:,} bytes "
            "(put data in the input Parquet, not in the job)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise JobError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise JobError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    return parse_job(data, source=str(path))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: the problem and where, without the snippet PyYAML draws under it."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        context = f"{exc.context}: " if exc.context else ""
        return cut(f"{context}{exc.problem}{where}", 500)
    return cut(" ".join(str(exc).split()), 500)
