"""A run's results as the files the batch services return, read part by part (one part
in memory at a time, whatever the run's size) and written tmp -> fsync -> rename:

- openai_batch: `output.jsonl` with one line per succeeded custom_id, in the shape
  `vllm run-batch` and OpenAI's Batch API write ({"id", "custom_id", "response":
  {"status_code": 200, "request_id", "body": <chat.completion | text_completion>},
  "error": null}), and `errors.jsonl` for error rows (status 400 for a request the
  engine never ran, 500 for an engine failure; the body holds OpenAI's error object);
- anthropic_batch: `results.jsonl`, {"custom_id", "result": {"type": "succeeded",
  "message": {...}} | {"type": "errored", "error": {...}}}.

A row's n completions are one response with n choices; a custom_id is in exactly one
file, once (a run commits a row's completions together, in one part, and live parts
never share an id). Ids in the files are derived from the run's fingerprint and the
custom_id, so exporting twice writes the same files."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from batchgen.job_spec import JobError
from batchgen.run_dir import RunDir, fsync_dir, tmp_name

FORMATS = ("openai_batch", "anthropic_batch")
COMPLETIONS_ENDPOINT = "/v1/completions"
# Error types of rows the engine never ran: the request's own fault (HTTP 400).
REQUEST_ERRORS = {
    "invalid_request",
    "prompt_too_long",
    "empty_prompt",
    "null_input",
    "render_error",
    "engine_rejected",  # the engine refused the request alone (a prompt over its context)
}
_COLUMNS = [
    "id",
    "n_index",
    "status",
    "text",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "error",
    "error_type",
    "model",
    "job_fingerprint",
]
# Read when the run's parts have them: the endpoint a request named, the prompt tokens
# served from the prefix cache, the per-token log-probabilities.
_OPTIONAL_COLUMNS = ["endpoint", "cached_prompt_tokens", "logprobs"]


@dataclass
class ExportSummary:
    files: dict[str, int]  # file name -> lines written
    succeeded: int
    errored: int


def export_run(run_path: str | Path, fmt: str, out_dir: str | Path, partial: bool = False):
    """Write the run's results in `fmt` under `out_dir`. Refuses (JobError) a directory
    that is not a run, and an unfinished run unless `partial`."""
    if fmt not in FORMATS:
        raise JobError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    run_dir = RunDir(run_path)
    if not run_dir.exists():
        raise JobError(f"{run_path}: not a batchgen run directory (no job.json)")
    if not run_dir.success.exists() and not partial:
        raise JobError(
            f"{run_path}: the run has not finished (no _SUCCESS), so some requests would be "
            "missing from the export; finish it with `batchgen run`, or pass --partial"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = _requests(run_dir)
    if fmt == "openai_batch":
        return _write_openai(rows, out)
    return _write_anthropic(rows, out)


def _requests(run_dir: RunDir) -> Iterator[tuple[list[dict], float]]:
    """Each custom_id's result rows (n_index order) and its part's commit time."""
    for entry in run_dir.live_parts():
        path = run_dir.results / entry.part
        names = set(pq.read_schema(path).names)
        columns = _COLUMNS + [c for c in _OPTIONAL_COLUMNS if c in names]
        table = pq.read_table(path, columns=columns)
        grouped: dict[Any, list[dict]] = {}
        for row in table.to_pylist():
            grouped.setdefault(row["id"], []).append(row)
        del table
        for rows in grouped.values():
            rows.sort(key=lambda r: r["n_index"])
            yield rows, entry.time


def _hashed(prefix: str, *parts: Any) -> str:
    blob = "\0".join(str(p) for p in (prefix, *parts)).encode()
    return prefix + hashlib.blake2b(blob, digest_size=12).hexdigest()


class _AtomicLines:
    """A JSONL file written to a tmp name, fsynced and renamed into place on close."""

    def __init__(self, path: Path):
        self.path = path
        self.tmp = tmp_name(path)
        # Closed by commit() or abort(): the file outlives this constructor.
        self.file = open(self.tmp, "w", encoding="utf-8")  # noqa: SIM115
        self.lines = 0

    def write(self, obj: dict) -> None:
        self.file.write(json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n")
        self.lines += 1

    def commit(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def _write_files(names: list[str], out: Path, fill) -> ExportSummary:
    files = [_AtomicLines(out / name) for name in names]
    try:
        succeeded, errored = fill(*files)
        for f in files:
            f.commit()
    except BaseException:
        for f in files:
            f.abort()
        raise
    return ExportSummary({f.path.name: f.lines for f in files}, succeeded, errored)


def _usage(rows: list[dict]) -> dict:
    prompt = rows[0]["prompt_tokens"] or 0
    completion = sum(r["completion_tokens"] or 0 for r in rows)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": rows[0].get("cached_prompt_tokens") or 0},
    }


def _token_bytes(item: dict) -> list[int]:
    raw = item.get("bytes")
    return list(raw if raw is not None else (item.get("token") or "").encode("utf-8"))


def chat_logprobs(logprobs: list[dict] | None) -> dict | None:
    """The logprobs column of one completion in chat.completion's shape."""
    if logprobs is None:
        return None
    return {
        "content": [
            {
                "token": item["token"],
                "logprob": item["logprob"],
                "bytes": _token_bytes(item),
                "top_logprobs": [
                    {"token": t["token"], "logprob": t["logprob"], "bytes": _token_bytes(t)}
                    for t in item.get("top_logprobs") or []
                ],
            }
            for item in logprobs
        ]
    }


def completion_logprobs(logprobs: list[dict] | None) -> dict | None:
    """The logprobs column of one completion in text_completion's shape."""
    if logprobs is None:
        return None
    offsets, at = [], 0
    for item in logprobs:
        offsets.append(at)
        at += len(item["token"] or "")
    return {
        "tokens": [item["token"] for item in logprobs],
        "token_logprobs": [item["logprob"] for item in logprobs],
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in item.get("top_logprobs") or []} for item in logprobs
        ],
        "text_offset": offsets,
    }


def openai_body(rows: list[dict], created: float) -> dict:
    """The chat.completion (or text_completion, for /v1/completions requests) of a row."""
    first = rows[0]
    custom_id = str(first["id"])
    completion = first.get("endpoint") == COMPLETIONS_ENDPOINT
    choices = []
    for r in rows:
        choice: dict[str, Any] = {"index": r["n_index"]}
        if completion:
            choice["text"] = r["text"]
            choice["logprobs"] = completion_logprobs(r.get("logprobs"))
        else:
            choice["message"] = {"role": "assistant", "content": r["text"]}
            choice["logprobs"] = chat_logprobs(r.get("logprobs"))
        choice["finish_reason"] = r["finish_reason"]
        choices.append(choice)
    prefix = "cmpl-" if completion else "chatcmpl-"
    return {
        "id": _hashed(prefix, first["job_fingerprint"], custom_id),
        "object": "text_completion" if completion else "chat.completion",
        "created": int(created),
        "model": first["model"],
        "choices": choices,
        "usage": _usage(rows),
    }


def _first_error(rows: list[dict]) -> dict:
    return next(r for r in rows if r["status"] != "ok")


def openai_error_line(rows: list[dict]) -> dict:
    bad = _first_error(rows)
    custom_id = str(bad["id"])
    request_fault = bad["error_type"] in REQUEST_ERRORS
    return {
        "id": _hashed("batch_req_", bad["job_fingerprint"], custom_id),
        "custom_id": custom_id,
        "response": {
            "status_code": 400 if request_fault else 500,
            "request_id": _hashed("req_", bad["job_fingerprint"], custom_id),
            "body": {
                "error": {
                    "message": bad["error"],
                    "type": "invalid_request_error" if request_fault else "server_error",
                    "param": None,
                    "code": bad["error_type"],
                }
            },
        },
        "error": None,
    }


def _write_openai(requests, out: Path) -> ExportSummary:
    def fill(output: _AtomicLines, errors: _AtomicLines) -> tuple[int, int]:
        ok = bad = 0
        for rows, created in requests:
            if all(r["status"] == "ok" for r in rows):
                custom_id = str(rows[0]["id"])
                fingerprint = rows[0]["job_fingerprint"]
                output.write(
                    {
                        "id": _hashed("batch_req_", fingerprint, custom_id),
                        "custom_id": custom_id,
                        "response": {
                            "status_code": 200,
                            "request_id": _hashed("req_", fingerprint, custom_id),
                            "body": openai_body(rows, created),
                        },
                        "error": None,
                    }
                )
                ok += 1
            else:
                errors.write(openai_error_line(rows))
                bad += 1
        return ok, bad

    return _write_files(["output.jsonl", "errors.jsonl"], out, fill)


_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def anthropic_result(rows: list[dict]) -> dict:
    first = rows[0]
    custom_id = str(first["id"])
    if len(rows) > 1:
        raise JobError(
            f"--format anthropic_batch: request {custom_id!r} has {len(rows)} completions "
            "(n > 1), which a Messages API result cannot hold; export as openai_batch"
        )
    if first["status"] != "ok":
        kind = "invalid_request_error" if first["error_type"] in REQUEST_ERRORS else "api_error"
        error = {"type": "error", "error": {"type": kind, "message": first["error"]}}
        return {"custom_id": custom_id, "result": {"type": "errored", "error": error}}
    message = {
        "id": _hashed("msg_", first["job_fingerprint"], custom_id),
        "type": "message",
        "role": "assistant",
        "model": first["model"],
        "content": [{"type": "text", "text": first["text"]}],
        "stop_reason": _STOP_REASONS.get(first["finish_reason"], first["finish_reason"]),
        "stop_sequence": None,
        "usage": {
            "input_tokens": first["prompt_tokens"] or 0,
            "output_tokens": first["completion_tokens"] or 0,
            "cache_read_input_tokens": first.get("cached_prompt_tokens") or 0,
            "cache_creation_input_tokens": 0,
        },
    }
    return {"custom_id": custom_id, "result": {"type": "succeeded", "message": message}}


def _write_anthropic(requests, out: Path) -> ExportSummary:
    def fill(results: _AtomicLines) -> tuple[int, int]:
        ok = bad = 0
        for rows, _ in requests:
            line = anthropic_result(rows)
            results.write(line)
            if line["result"]["type"] == "succeeded":
                ok += 1
            else:
                bad += 1
        return ok, bad

    return _write_files(["results.jsonl"], out, fill)
