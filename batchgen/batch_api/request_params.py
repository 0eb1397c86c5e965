"""Per-row sampling parameters, validated one by one as the batch services validate a
request: a wrong value is the row's error (RequestError naming the key as the user wrote
it), never a job error and never a silent default.

Parameters arrive as (parameter, value, label): the canonical name below, the raw value,
and where it came from ("body.max_completion_tokens", "column 'max_new'") for messages."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from batchgen.job_spec import short_repr
from batchgen.row_sampling import RowSampling

# vLLM's names for constraints that OpenAI's shapes put under response_format.
GUIDED_PARAMETERS = ("guided_regex", "guided_choice", "guided_json")
# Bounds the services set (OpenAI: n <= 128, top_logprobs <= 20, penalties in [-2, 2]).
MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1000
MAX_CHOICES = 4096
INT64 = (-(1 << 63), (1 << 63) - 1)
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "regex", "choice")


class RequestError(Exception):
    """A request (or a row's parameter) whose own values are wrong: the row becomes an
    error row with this message; `key` is where, as the user wrote it."""

    def __init__(self, key: str, message: str, error_type: str = "invalid_request"):
        super().__init__(f"{key}: {message}")
        self.key = key
        self.error_type = error_type


def described(value: Any) -> str:
    return f"got {type(value).__name__} {short_repr(value)}"


def _number(label: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(label, f"expected a number, {described(value)}")
    if not math.isfinite(value) or value > hi or value < lo or (lo_open and value == lo):
        low = f"({lo}" if lo_open else f"[{lo}"
        raise RequestError(label, f"expected a number in {low}, {hi}], {described(value)}")
    return float(value)


def _integer(label: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(label, f"expected an integer, {described(value)}")
    if not lo <= value <= hi:
        raise RequestError(label, f"expected an integer in [{lo}, {hi}], {described(value)}")
    return value


def _stop(label: str, value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise RequestError(label, f"expected a string or a list of strings, {described(value)}")
    if len(items) > MAX_STOP_STRINGS:
        raise RequestError(label, f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise RequestError(label, f"a stop string is at most {MAX_STOP_CHARS} characters")
    return tuple(s for s in items if s)


def _schema(label: str, value: Any) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestError(label, f"not valid JSON, {described(value)}") from None
    if not isinstance(value, dict):
        raise RequestError(label, f"expected a JSON schema object, {described(value)}")
    return value


def _choices(label: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise RequestError(
            label, f"expected a non-empty list of non-empty strings, {described(value)}"
        )
    if len(value) > MAX_CHOICES:
        raise RequestError(label, f"at most {MAX_CHOICES} choices, got {len(value)}")
    return list(value)


def _only_keys(label: str, value: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in value if k not in allowed)
    if unknown:
        raise RequestError(f"{label}.{unknown[0]}", "unknown key")


def response_format(label: str, value: Any) -> dict | None:
    """A response_format in OpenAI's shapes (text, json_object, json_schema) or the regex
    and choice shapes, normalized; None for text (no constraint)."""
    if isinstance(value, str):  # a Parquet column may hold it as JSON text
        try:
            value = json.loads(value)
        except ValueError:
            raise RequestError(label, f"not valid JSON, {described(value)}") from None
    if not isinstance(value, dict):
        raise RequestError(label, f"expected an object with a 'type', {described(value)}")
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise RequestError(
            f"{label}.type",
            f"expected one of {', '.join(RESPONSE_FORMAT_TYPES)}, {described(kind)}",
        )
    if kind in ("text", "json_object"):
        _only_keys(label, value, {"type"})
        return None if kind == "text" else {"type": "json_object"}
    if kind == "regex":
        _only_keys(label, value, {"type", "regex"})
        regex = value.get("regex")
        if not isinstance(regex, str) or not regex:
            raise RequestError(f"{label}.regex", f"expected a non-empty string, {described(regex)}")
        return {"type": "regex", "regex": regex}
    if kind == "choice":
        _only_keys(label, value, {"type", "choice"})
        return {"type": "choice", "choice": _choices(f"{label}.choice", value.get("choice"))}
    _only_keys(label, value, {"type", "json_schema"})
    spec = value.get("json_schema")
    where = f"{label}.json_schema"
    if not isinstance(spec, dict):
        raise RequestError(where, f"expected an object with a 'schema', {described(spec)}")
    _only_keys(where, spec, {"name", "schema", "strict", "description"})
    if "schema" not in spec:
        raise RequestError(f"{where}.schema", "missing")
    out: dict[str, Any] = {"schema": _schema(f"{where}.schema", spec["schema"])}
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise RequestError(f"{where}.name", f"expected a string, {described(name)}")
    out["name"] = name or "response"
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError(f"{where}.strict", f"expected true or false, {described(strict)}")
    if strict is not None:
        out["strict"] = strict
    return {"type": "json_schema", "json_schema": out}


def _logprobs(label: str, value: Any) -> int | None:
    """logprobs: true/false (chat), or an integer k of alternatives (completions)."""
    if value is None or value is False:
        return None
    if value is True:
        return 0
    return _integer(label, value, 0, MAX_TOP_LOGPROBS)


def _guided(param: str, label: str, value: Any) -> dict:
    if param == "guided_regex":
        if not isinstance(value, str) or not value:
            raise RequestError(label, f"expected a non-empty string, {described(value)}")
        return {"type": "regex", "regex": value}
    if param == "guided_choice":
        return {"type": "choice", "choice": _choices(label, value)}
    schema = _schema(label, value)
    return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}


def resolve(base: RowSampling, given: Iterable[tuple[str, Any, str]]) -> RowSampling:
    """`base` with the given (parameter, value, label) put over it, each value validated.
    A None value leaves the base's (a null in a Parquet column, an explicit JSON null).
    Raises RequestError for the first wrong value."""
    changes: dict[str, Any] = {}
    labels: dict[str, str] = {}
    top_logprobs: tuple[int, str] | None = None
    logprobs_given: tuple[Any, str] | None = None
    for param, value, label in given:
        if value is None:
            continue
        if param in GUIDED_PARAMETERS or param == "response_format":
            fmt = response_format(label, value) if param == "response_format" else None
            if param != "response_format":
                fmt = _guided(param, label, value)
            if "response_format" in labels and fmt is not None:
                raise RequestError(
                    label, f"conflicts with {labels['response_format']}: give one constraint"
                )
            if fmt is not None:
                changes["response_format"] = fmt
                labels["response_format"] = label
            continue
        if param in labels:
            raise RequestError(label, f"conflicts with {labels[param]}: give one of them")
        labels[param] = label
        if param == "temperature":
            changes[param] = _number(label, value, 0.0, 1e6)
        elif param == "top_p":
            changes[param] = _number(label, value, 0.0, 1.0, lo_open=True)
        elif param == "top_k":
            changes[param] = max(_integer(label, value, -1, 1 << 31), 0)
        elif param == "min_p":
            changes[param] = _number(label, value, 0.0, 1.0)
        elif param == "max_tokens":
            changes[param] = _integer(label, value, 1, 1 << 31)
        elif param == "stop":
            changes[param] = _stop(label, value)
        elif param == "seed":
            changes[param] = _integer(label, value, *INT64)
        elif param == "n":
            changes[param] = _integer(label, value, 1, MAX_N)
        elif param in ("presence_penalty", "frequency_penalty"):
            changes[param] = _number(label, value, -2.0, 2.0)
        elif param == "logprobs":
            logprobs_given = (value, label)
            changes[param] = _logprobs(label, value)
        elif param == "top_logprobs":
            top_logprobs = (_integer(label, value, 0, MAX_TOP_LOGPROBS), label)
        else:
            raise RequestError(label, "unknown parameter")
    if top_logprobs is not None:
        k, label = top_logprobs
        if logprobs_given is None or logprobs_given[0] is not True:
            raise RequestError(label, "needs logprobs: true")
        changes["logprobs"] = k
    return base.replace(**changes) if changes else base
