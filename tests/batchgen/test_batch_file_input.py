"""OpenAI Batch and Anthropic Message Batches request files as a job's input: the file is
checked whole before any work (bad lines refuse the job, naming every line), a request
whose own values are wrong becomes an error row for its custom_id, and the rest run with
their own parameters. Over the fake engine; test_batch_api_end_to_end.py runs the real one."""

from __future__ import annotations

import json
import random

import polars as pl
import pytest

from batchgen.batch_api.jsonl_input import MAX_NAMED_LINES, detect_format
from batchgen.job_context import open_job
from batchgen.job_spec import InputSpec, JobError, parse_job
from batchgen.request_feed import derive_seed
from batchgen.run import EXIT_OK, EXIT_SOME_ERRORS
from tests.batchgen.batch_files import (
    anthropic_message,
    batch_job,
    openai_chat,
    openai_completion,
    run,
    write_jsonl,
)
from tests.batchgen.conftest import FakeLLM


def _results(tmp_path) -> pl.DataFrame:
    return pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")


def _refusal(tmp_path, lines) -> str:
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    job = parse_job(batch_job(tmp_path, data, str(tmp_path)))
    with pytest.raises(JobError) as exc:
        open_job(job)
    assert not (tmp_path / "run").exists()
    return str(exc.value)


def test_bad_lines_refuse_the_job_naming_every_line(tmp_path):
    lines = [
        openai_chat("a", "hello"),
        "{not json",
        openai_chat("b", "hi"),
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},  # no custom_id
        "",  # blank lines are not requests
        openai_chat("a", "again"),
        "[1, 2]",
        {"custom_id": "", "body": {}},
        openai_chat("b", "and again"),
        openai_chat("a", "third"),
    ]
    message = _refusal(tmp_path, lines)
    assert "not a JSON object at line(s) 2, 7" in message
    assert "no custom_id (a non-empty string) at line(s) 4, 8" in message
    assert "'a' at lines 1, 6, 10" in message and "'b' at lines 3, 9" in message


def test_refusal_lists_lines_up_to_a_limit(tmp_path):
    extra = 7
    lines = [openai_chat("ok", "fine")] + ["oops"] * (MAX_NAMED_LINES + extra)
    message = _refusal(tmp_path, lines)
    named = ", ".join(str(i) for i in range(2, 2 + MAX_NAMED_LINES))
    assert f"at line(s) {named} and {extra} more" in message


def test_an_empty_file_is_refused(tmp_path):
    assert "holds no requests" in _refusal(tmp_path, ["", "  "])


def test_format_from_extension_then_content(tmp_path):
    openai = write_jsonl(tmp_path / "o.jsonl", [openai_chat("a", "x")])
    anthropic = write_jsonl(tmp_path / "a.txt", [anthropic_message("a", "x")])
    assert detect_format(InputSpec(path=str(openai))) == "openai_batch"
    assert detect_format(InputSpec(path=str(anthropic))) == "anthropic_batch"
    assert detect_format(InputSpec(path=str(tmp_path / "in.parquet"))) == "parquet"
    explicit = InputSpec(path=str(anthropic), format="openai_batch")
    assert detect_format(explicit) == "openai_batch"


def test_prompt_is_optional_only_for_request_files(tmp_path):
    base = {"input": {"path": "in.parquet"}, "output": {"path": "run"}}
    with pytest.raises(JobError, match="missing key 'prompt'"):
        parse_job(base)
    parse_job({**base, "input": {"path": "in.parquet", "format": "openai_batch"}})
    parse_job({**base, "input": {"path": "requests.jsonl"}})


def test_job_settings_a_request_file_does_not_use_are_refused(tmp_path):
    data = write_jsonl(tmp_path / "b.jsonl", [openai_chat("a", "x")])
    for section, values, key in [
        ("prompt", {"template": "{{ x }}"}, "prompt"),
        ("input", {"id_column": "custom_id"}, "input.id_column"),
        ("sampling", {"from_columns": {"max_tokens": "m"}}, "sampling.from_columns"),
        ("batching", {"cluster": "lang"}, "batching.cluster"),
    ]:
        job = parse_job(batch_job(tmp_path, data, str(tmp_path), **{section: values}))
        with pytest.raises(JobError, match=key):
            open_job(job)


BAD_REQUESTS = {
    "max_tokens_text": (openai_chat("x", "hi", max_tokens="ten"), "body.max_tokens"),
    "bool_n": (openai_chat("x", "hi", n=True), "body.n"),
    "bad_url": ({**openai_chat("x", "hi"), "url": "/v1/embeddings"}, "url"),
    "get": ({**openai_chat("x", "hi"), "method": "GET"}, "method"),
    "unknown_param": (openai_chat("x", "hi", frobnicate=1), "body.frobnicate"),
    "bad_role": (
        openai_chat("x", "hi", messages=[{"role": "wizard", "content": "hi"}]),
        "body.messages[0].role",
    ),
    "image_part": (
        openai_chat("x", "hi", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "body.messages[0].content[0].type",
    ),
    "top_p_zero": (openai_chat("x", "hi", top_p=0), "body.top_p"),
    "too_many_top_logprobs": (
        openai_chat("x", "hi", logprobs=True, top_logprobs=21),
        "body.top_logprobs",
    ),
    "top_logprobs_alone": (openai_chat("x", "hi", top_logprobs=2), "body.top_logprobs"),
    "two_max_tokens": (
        openai_chat("x", "hi", max_tokens=3, max_completion_tokens=5),
        "body.max_completion_tokens",
    ),
    "stream": (openai_chat("x", "hi", stream=True), "body.stream"),
    "bad_schema": (
        openai_chat("x", "hi", response_format={"type": "json_schema", "json_schema": {}}),
        "body.response_format.json_schema.schema",
    ),
    "completion_prompt_list": (openai_completion("x", ["a", "b"]), "body.prompt"),
    "no_messages": ({**openai_chat("x", "hi"), "body": {"model": "m"}}, "body.messages"),
    "huge_max_tokens": (openai_chat("x", "hi", max_tokens=10_000), "max_tokens"),
}


def test_wrong_requests_become_error_rows_and_the_rest_run(tmp_path):
    lines, expected = [], {}
    for i, (name, (line, key)) in enumerate(BAD_REQUESTS.items()):
        lines.append({**line, "custom_id": name})
        lines.append(openai_chat(f"good{i}", f"Translate sentence {i}"))
        expected[name] = key
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    outcome = run(batch_job(tmp_path, data, str(tmp_path)), FakeLLM())
    assert outcome.exit_code == EXIT_SOME_ERRORS
    df = _results(tmp_path)
    assert sorted(df["id"]) == sorted(line["custom_id"] for line in lines)
    for row in df.iter_rows(named=True):
        if row["id"].startswith("good"):
            assert row["status"] == "ok", row
            continue
        assert row["status"] == "error"
        assert row["error"].startswith(expected[row["id"]] + ":"), row
        assert row["error_type"] in ("invalid_request", "prompt_too_long"), row


def test_request_parameters_apply_per_row(tmp_path):
    rng = random.Random()
    wants = {f"r{i}": (rng.randrange(1, 9), rng.randrange(1, 4)) for i in range(12)}
    lines = [
        openai_chat(cid, f"question {cid}", max_completion_tokens=m, n=n)
        for cid, (m, n) in wants.items()
    ]
    lines.append(openai_chat("seeded", "question", seed=4242, n=2))
    lines.append(openai_completion("plain", "Once upon a time", max_tokens=3))
    lines.append(openai_completion("ids", [5, 6, 7], max_tokens=2))
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    job = batch_job(tmp_path, data, str(tmp_path), sampling={"seed": 7, "max_tokens": 5})
    assert run(job, FakeLLM()).exit_code == EXIT_OK
    df = _results(tmp_path)
    for cid, (m, n) in wants.items():
        rows = df.filter(pl.col("id") == cid).sort("n_index")
        assert rows["n_index"].to_list() == list(range(n))
        assert rows["completion_tokens"].to_list() == [m] * n  # the fake runs to max_tokens
        assert rows["seed"].to_list() == [derive_seed(7, cid, k) for k in range(n)]
    seeded = df.filter(pl.col("id") == "seeded").sort("n_index")
    assert seeded["seed"].to_list() == [derive_seed(4242, "seeded", k) for k in range(2)]
    assert df.filter(pl.col("id") == "plain")["completion_tokens"].to_list() == [3]
    assert df.filter(pl.col("id") == "ids")["prompt_tokens"].to_list() == [3]
    assert set(df["endpoint"]) == {"/v1/chat/completions", "/v1/completions"}
    assert set(df["request_model"]) == {"gpt-4o-mini", "gpt-3.5-turbo-instruct"}


def test_anthropic_requests(tmp_path):
    lines = [
        anthropic_message("a", "Summarize the report.", max_tokens=3, system="Be brief."),
        anthropic_message("b", "Confirm the date.", stop_sequences=["\n"], top_k=5),
        anthropic_message("c", "hi", seed=3),  # not a Messages API parameter
        anthropic_message(
            "d", "hi", messages=[{"role": "system", "content": "x"}]
        ),  # system is its own key
        {"custom_id": "e", "params": {"model": "m", "messages": []}},  # no max_tokens
    ]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    assert run(batch_job(tmp_path, data, str(tmp_path)), FakeLLM()).exit_code == EXIT_SOME_ERRORS
    df = _results(tmp_path).sort("id")
    assert df["status"].to_list() == ["ok", "ok", "error", "error", "error"]
    assert df["completion_tokens"].to_list()[:2] == [3, 4]
    errors = dict(zip(df["id"], df["error"]))
    assert errors["c"].startswith("params.seed:")
    assert errors["d"].startswith("params.messages[0].role:")
    assert errors["e"].startswith("params.max_tokens:")
    assert set(df["endpoint"]) == {"/v1/messages"}


def test_requests_are_embedded_by_their_messages_for_task_clusters(tmp_path):
    from batchgen.task_clusters import prompt_texts

    lines = [
        openai_chat("a", "Translate the memo", messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Translate the memo"},
        ]),
        openai_completion("b", "Once upon a time"),
        openai_chat("c", "hi", messages=[{"role": "wizard", "content": "x"}]),
    ]  # fmt: skip
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    job = parse_job(batch_job(tmp_path, data, str(tmp_path), batching={"cluster": "auto"}))
    ctx = open_job(job)
    texts = dict(prompt_texts(job, ctx.input.rows()))
    assert texts == {"a": "Translate the memo", "b": "Once upon a time", "c": None}


def test_checking_a_large_file_holds_no_line_in_memory(tmp_path):
    """20,000 requests (~7 MB): the whole-file check keeps a hash per line, not lines."""
    import tracemalloc

    from batchgen.batch_api.jsonl_input import BatchFileInput

    line = '{"custom_id": "r%07d", "method": "POST", "url": "/v1/chat/completions", ' + (
        '"body": {"messages": [{"role": "user", "content": "%s"}]}}\n'
    )
    count = 20_000
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(count):
            f.write(line % (i, "x" * 240))
    source = BatchFileInput(InputSpec(path=str(path)), "openai_batch")
    tracemalloc.start()
    try:
        assert source.check_ids() == count
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert path.stat().st_size > 6e6
    assert peak < 2e6, peak  # the hashes (a list of 20,000 ints): ~1 MB


def test_interrupted_batch_file_run_resumes_and_exports_each_custom_id_once(tmp_path):
    from batchgen.run import EXIT_INTERRUPTED
    from tests.batchgen.test_run_loop import _InterruptingLLM

    lines = [openai_chat(f"q{i}", f"question {i}", n=1 + i % 2) for i in range(30)]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    job = batch_job(tmp_path, data, str(tmp_path), output={"export": "openai_batch"})
    assert run(job, _InterruptingLLM(after=17)).exit_code == EXIT_INTERRUPTED
    assert not (tmp_path / "run" / "export").exists()  # exported only once finished
    committed = set(_results(tmp_path)["id"])
    assert committed
    second = FakeLLM()
    assert run(job, second).exit_code == EXIT_OK
    df = _results(tmp_path)
    assert len(df) == sum(1 + i % 2 for i in range(30))
    assert second.pulled == sum(1 + i % 2 for i in range(30) if f"q{i}" not in committed)
    output = (tmp_path / "run" / "export" / "output.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in output) == sorted(f"q{i}" for i in range(30))


def test_a_request_that_cannot_run_has_an_error_row_per_completion(tmp_path):
    lines = [openai_chat("long", "hi", n=3, max_tokens=100_000), openai_chat("ok", "hi")]
    data = write_jsonl(tmp_path / "batch.jsonl", lines)
    assert run(batch_job(tmp_path, data, str(tmp_path)), FakeLLM()).exit_code == EXIT_SOME_ERRORS
    long = _results(tmp_path).filter(pl.col("id") == "long").sort("n_index")
    assert long["n_index"].to_list() == [0, 1, 2]
    assert set(long["error_type"]) == {"prompt_too_long"}
