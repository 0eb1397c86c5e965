"""`batchgen export`: a run's result parts as OpenAI batch (output.jsonl + errors.jsonl)
and Anthropic (results.jsonl) files, checked against hand-built parts holding the optional
columns other stages write (cached_prompt_tokens, logprobs)."""

from __future__ import annotations

import json
import random
import string

import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchgen.batch_api.export import export_run
from batchgen.cli import main
from batchgen.job_spec import JobError
from batchgen.run_dir import RunDir
from batchgen.writer import commit_part, result_schema

TOP = pa.struct(
    [("token", pa.string()), ("token_id", pa.int32()), ("bytes", pa.binary()),
     ("logprob", pa.float64())]
)  # fmt: skip
LOGPROBS = pa.list_(
    pa.struct(
        [("token", pa.string()), ("token_id", pa.int32()), ("bytes", pa.binary()),
         ("logprob", pa.float64()), ("top_logprobs", pa.list_(TOP))]
    )
)  # fmt: skip
CARRY = [
    pa.field("request_model", pa.string()),
    pa.field("endpoint", pa.string()),
]
FINGERPRINT = "f" * 16


def _token(rng: random.Random) -> dict:
    text = "".join(rng.choice(string.ascii_letters + "é ") for _ in range(rng.randrange(1, 4)))
    return {
        "token": text,
        "token_id": rng.randrange(1000),
        "bytes": text.encode(),
        "logprob": -rng.random() * 5,
    }


def _completion(rng: random.Random, with_logprobs: bool, k: int) -> tuple[str, list | None]:
    tokens = [_token(rng) for _ in range(rng.randrange(1, 6))]
    text = "".join(t["token"] for t in tokens)
    if not with_logprobs:
        return text, None
    return text, [{**t, "top_logprobs": [_token(rng) for _ in range(k)]} for t in tokens]


def _result(custom_id, n_index, *, rng, endpoint, ok=True, n_prompt=7, logprobs_k=None):
    text, logprobs = _completion(rng, logprobs_k is not None, logprobs_k or 0)
    return {
        "id": custom_id,
        "n_index": n_index,
        "status": "ok" if ok else "error",
        "text": text if ok else None,
        "finish_reason": rng.choice(["stop", "length"]) if ok else None,
        "prompt_tokens": n_prompt,
        "completion_tokens": len(logprobs) if logprobs else rng.randrange(1, 9),
        "cluster_id": None,
        "error": None if ok else "body.max_tokens: expected an integer, got str 'ten'",
        "error_type": None if ok else "invalid_request",
        "seed": 1,
        "model": "tiny-llama",
        "job_fingerprint": FINGERPRINT,
        "request_model": "gpt-4o-mini",
        "endpoint": endpoint,
        "cached_prompt_tokens": rng.randrange(0, n_prompt) if ok else None,
        "logprobs": logprobs if ok else None,
    }


def _make_run(tmp_path, parts: list[list[dict]], finished: bool = True):
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    run_dir.job_file.write_text(json.dumps({"fingerprint": FINGERPRINT}))
    schema = result_schema(CARRY)
    for i, rows in enumerate(parts):
        table = pa.Table.from_pylist(rows, schema=schema)
        commit_part(run_dir, table, f"part-{i:05d}.parquet", FINGERPRINT, "s1")
    if finished:
        run_dir.success.write_text("")
    return run_dir.path


def _read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def mixed_run(tmp_path):
    """Three parts: chat rows with n 1..3 (some with logprobs), completion rows, errors."""
    rng = random.Random()
    parts, expected = [], {}
    for p in range(3):
        rows = []
        for i in range(6):
            cid = f"p{p}-r{i}"
            endpoint = "/v1/completions" if i % 3 == 2 else "/v1/chat/completions"
            n = 1 + (i % 3)
            ok = i != 4
            k = rng.randrange(0, 4) if i % 2 == 0 else None
            group = [
                _result(cid, j, rng=rng, endpoint=endpoint, ok=ok, logprobs_k=k) for j in range(n)
            ]
            for r in group[1:]:
                r["prompt_tokens"] = group[0]["prompt_tokens"]
                r["cached_prompt_tokens"] = group[0]["cached_prompt_tokens"]
            rows += group
            expected[cid] = group
        parts.append(rows)
    return _make_run(tmp_path, parts), expected


def test_openai_export(mixed_run, tmp_path):
    run_path, expected = mixed_run
    summary = export_run(run_path, "openai_batch", tmp_path / "out")
    output = _read(tmp_path / "out" / "output.jsonl")
    errors = _read(tmp_path / "out" / "errors.jsonl")
    ids = [line["custom_id"] for line in output + errors]
    assert sorted(ids) == sorted(expected)  # every custom_id exactly once
    assert summary.succeeded == len(output) and summary.errored == len(errors)
    for line in output:
        rows = expected[line["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        chat = rows[0]["endpoint"] == "/v1/chat/completions"
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert body["model"] == "tiny-llama"
        assert [c["index"] for c in body["choices"]] == list(range(len(rows)))
        completion_tokens = sum(r["completion_tokens"] for r in rows)
        assert body["usage"] == {
            "prompt_tokens": rows[0]["prompt_tokens"],
            "completion_tokens": completion_tokens,
            "total_tokens": rows[0]["prompt_tokens"] + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": rows[0]["cached_prompt_tokens"]},
        }
        for choice, row in zip(body["choices"], rows):
            assert choice["finish_reason"] == row["finish_reason"]
            text = choice["message"]["content"] if chat else choice["text"]
            assert text == row["text"]
            if chat:
                assert choice["message"]["role"] == "assistant"
            _check_logprobs(choice["logprobs"], row["logprobs"], chat)
    for line in errors:
        row = expected[line["custom_id"]][0]
        assert line["response"]["status_code"] == 400
        assert line["response"]["body"]["error"]["message"] == row["error"]
        assert line["response"]["body"]["error"]["code"] == "invalid_request"
    # The same run exports to the same bytes (ids derive from fingerprint and custom_id).
    export_run(run_path, "openai_batch", tmp_path / "again")
    for name in ("output.jsonl", "errors.jsonl"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def _check_logprobs(got, logprobs, chat: bool) -> None:
    if logprobs is None:
        assert got is None
        return
    if chat:
        assert [c["token"] for c in got["content"]] == [t["token"] for t in logprobs]
        for c, t in zip(got["content"], logprobs):
            assert c["logprob"] == t["logprob"] and bytes(c["bytes"]) == t["bytes"]
            assert [a["token"] for a in c["top_logprobs"]] == [
                a["token"] for a in t["top_logprobs"]
            ]
            assert [a["logprob"] for a in c["top_logprobs"]] == [
                a["logprob"] for a in t["top_logprobs"]
            ]
        return
    assert got["tokens"] == [t["token"] for t in logprobs]
    assert got["token_logprobs"] == [t["logprob"] for t in logprobs]
    offsets = [sum(len(t["token"]) for t in logprobs[:i]) for i in range(len(logprobs))]
    assert got["text_offset"] == offsets
    assert got["top_logprobs"] == [
        {a["token"]: a["logprob"] for a in t["top_logprobs"]} for t in logprobs
    ]


def test_anthropic_export(tmp_path):
    rng = random.Random()
    rows = [_result(f"m{i}", 0, rng=rng, endpoint="/v1/messages", ok=i % 4 != 3) for i in range(9)]
    run_path = _make_run(tmp_path, [rows[:5], rows[5:]])
    export_run(run_path, "anthropic_batch", tmp_path / "out")
    lines = _read(tmp_path / "out" / "results.jsonl")
    assert sorted(line["custom_id"] for line in lines) == sorted(r["id"] for r in rows)
    by_id = {r["id"]: r for r in rows}
    for line in lines:
        row = by_id[line["custom_id"]]
        result = line["result"]
        if row["status"] != "ok":
            assert result["type"] == "errored"
            assert result["error"]["error"] == {
                "type": "invalid_request_error",
                "message": row["error"],
            }
            continue
        message = result["message"]
        assert result["type"] == "succeeded" and message["role"] == "assistant"
        assert message["content"] == [{"type": "text", "text": row["text"]}]
        stop = {"stop": "end_turn", "length": "max_tokens"}[row["finish_reason"]]
        assert message["stop_reason"] == stop
        assert message["usage"]["input_tokens"] == row["prompt_tokens"]
        assert message["usage"]["output_tokens"] == row["completion_tokens"]
        assert message["usage"]["cache_read_input_tokens"] == row["cached_prompt_tokens"]


def test_anthropic_export_refuses_n_above_one(mixed_run, tmp_path):
    run_path, _ = mixed_run
    with pytest.raises(JobError, match="n > 1"):
        export_run(run_path, "anthropic_batch", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written


def test_parts_without_the_optional_columns(tmp_path):
    rng = random.Random()
    rows = [_result("a", 0, rng=rng, endpoint=None)]
    for key in ("request_model", "endpoint", "cached_prompt_tokens", "logprobs"):
        del rows[0][key]
    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    run_dir.job_file.write_text("{}")
    commit_part(run_dir, pa.Table.from_pylist(rows, schema=result_schema([])), "part-00000.parquet",
                FINGERPRINT, "s")  # fmt: skip
    run_dir.success.write_text("")
    export_run(run_dir.path, "openai_batch", tmp_path / "out")
    (line,) = _read(tmp_path / "out" / "output.jsonl")
    body = line["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["choices"][0]["logprobs"] is None


def test_cli_refuses_an_unfinished_run_unless_partial(tmp_path):
    rng = random.Random()
    run_path = _make_run(
        tmp_path, [[_result("a", 0, rng=rng, endpoint="/v1/chat/completions")]], finished=False
    )
    runner = CliRunner()
    args = ["export", str(run_path), "--format", "openai_batch", "--out", str(tmp_path / "o")]
    refused = runner.invoke(main, args)
    assert refused.exit_code == 2 and "has not finished" in refused.output
    done = runner.invoke(main, [*args, "--partial"])
    assert done.exit_code == 0, done.output
    assert "1 succeeded and 0 errored" in done.output
    missing = runner.invoke(main, ["export", str(tmp_path / "nope"), "--format",
                                   "openai_batch", "--out", str(tmp_path / "o")])  # fmt: skip
    assert missing.exit_code == 2 and "not a batchgen run directory" in missing.output
