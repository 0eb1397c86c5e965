"""Structured output and logprobs through a real job on the tiny random llama: the job
keys reach the engine, the results carry the `logprobs` list column, and bad keys are
job errors naming them."""

from __future__ import annotations

import polars as pl
import pytest

from batchgen.job_spec import JobError, parse_job
from batchgen.progress import Progress
from batchgen.run import EXIT_OK, run_job
from engine import LLM

pytest.importorskip("llguidance")
CHOICES = ["yes", "no", "maybe later"]


class _Quiet:
    def write(self, _):
        pass

    def flush(self):
        pass

    def isatty(self):
        return False


def test_choice_job_with_logprobs(make_job, tiny_model_dir, tmp_path):
    job, path = make_job(
        model=str(tiny_model_dir),
        sampling={
            "temperature": 0.9,
            "max_tokens": 12,
            "logprobs": True,
            "top_logprobs": 2,
            "response_format": {"type": "choice", "choice": CHOICES},
        },  # fmt: skip
    )
    progress = Progress(None, tty=False, interval=3600, stream=_Quiet())
    llm = LLM(str(tiny_model_dir), device="cpu")
    outcome = run_job(parse_job(job), path, llm=llm, progress=progress)
    assert outcome.exit_code == EXIT_OK
    df = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    assert set(df["text"]) <= set(CHOICES) and set(df["finish_reason"]) == {"stop"}
    for text, completion_tokens, logprobs in zip(
        df["text"], df["completion_tokens"], df["logprobs"].to_list()
    ):
        assert len(logprobs) == completion_tokens
        assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in logprobs)
        # the tokens' bytes spell the text and the EOS that ended it
        joined = b"".join(e["bytes"] for e in logprobs[:-1]).decode()
        assert joined == text


def test_logprobs_column_is_null_when_not_asked(make_job, tiny_model_dir, tmp_path):
    job, path = make_job(model=str(tiny_model_dir), rows=None)
    progress = Progress(None, tty=False, interval=3600, stream=_Quiet())
    run_job(parse_job(job), path, llm=LLM(str(tiny_model_dir), device="cpu"), progress=progress)
    df = pl.read_parquet(tmp_path / "run" / "results" / "*.parquet")
    assert df["logprobs"].is_null().all()


@pytest.mark.parametrize(
    "sampling, words",
    [
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "json_schema"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_bad_sampling_keys_are_job_errors(make_job, sampling, words):
    job, _ = make_job(sampling=sampling)
    with pytest.raises(JobError, match=words):
        parse_job(job)


def test_a_job_schema_that_does_not_compile_refuses_the_job(make_job, tiny_model_dir, tmp_path):
    bad = {"type": "json_schema",
           "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}  # fmt: skip
    job, path = make_job(model=str(tiny_model_dir), sampling={"response_format": bad})
    progress = Progress(None, tty=False, interval=3600, stream=_Quiet())
    with pytest.raises(JobError, match="sampling.response_format.*frobnicate"):
        run_job(parse_job(job), path, llm=LLM(str(tiny_model_dir), device="cpu"), progress=progress)
    assert not (tmp_path / "run" / "results").exists()  # nothing was written
