"""Per-row sampling parameters: each value validated as the batch services do, put over
the job's, and mapped onto the engine's SamplingParams."""

from __future__ import annotations

import dataclasses
import random

import pytest

from batchgen.batch_api.request_params import RequestError, resolve, response_format
from batchgen.job_spec import SamplingSpec
from batchgen.row_sampling import RowSampling

BASE = RowSampling.from_job(SamplingSpec(temperature=0.3, max_tokens=9, seed=5, stop=["x"]))


def _random_values(rng: random.Random) -> dict:
    return {
        "temperature": rng.uniform(0, 2),
        "top_p": rng.uniform(0.01, 1),
        "top_k": rng.randrange(0, 100),
        "min_p": rng.uniform(0, 1),
        "max_tokens": rng.randrange(1, 4096),
        "stop": [f"s{rng.randrange(100)}" for _ in range(rng.randrange(1, 4))],
        "seed": rng.randrange(-(1 << 62), 1 << 62),
        "n": rng.randrange(1, 129),
        "presence_penalty": rng.uniform(-2, 2),
        "frequency_penalty": rng.uniform(-2, 2),
    }


def test_given_values_replace_the_jobs():
    rng = random.Random()
    for _ in range(20):
        values = _random_values(rng)
        given = rng.sample(sorted(values), rng.randrange(1, len(values) + 1))
        got = resolve(BASE, [(k, values[k], f"body.{k}") for k in given])
        for field in dataclasses.fields(RowSampling):
            want = values[field.name] if field.name in given else getattr(BASE, field.name)
            if field.name == "stop" and field.name in given:
                want = tuple(want)
            assert getattr(got, field.name) == want, field.name


def test_none_leaves_the_jobs_value():
    assert resolve(BASE, [("max_tokens", None, "column 'm' (max_tokens)")]) is BASE


@pytest.mark.parametrize(
    "param, value",
    [
        ("temperature", -0.1), ("temperature", "1"), ("temperature", float("nan")),
        ("top_p", 0), ("top_p", 1.5), ("top_k", 2.0), ("top_k", -2), ("min_p", 2),
        ("max_tokens", 0), ("max_tokens", "ten"), ("max_tokens", True), ("max_tokens", 3.0),
        ("stop", 5), ("stop", ["a", 1]), ("stop", ["x"] * 33), ("seed", 1 << 64),
        ("seed", "7"), ("n", 0), ("n", 129), ("presence_penalty", 2.5),
        ("frequency_penalty", True), ("logprobs", 21), ("logprobs", "yes"),
        ("top_logprobs", 3), ("response_format", {"type": "xml"}),
        ("response_format", {"type": "json_object", "schema": {}}),
        ("response_format", {"type": "regex"}), ("response_format", {"type": "choice", "choice": []}),
        ("guided_choice", ["a", ""]), ("guided_regex", 5), ("guided_json", "{not json"),
    ],
)  # fmt: skip
def test_wrong_values_name_the_key(param, value):
    with pytest.raises(RequestError) as exc:
        resolve(BASE, [(param, value, f"body.{param}")])
    assert str(exc.value).startswith(f"body.{param}")


def test_logprobs_and_top_logprobs():
    assert resolve(BASE, [("logprobs", True, "l")]).logprobs == 0
    assert resolve(BASE, [("logprobs", False, "l")]).logprobs is None
    both = [("logprobs", True, "l"), ("top_logprobs", 5, "t")]
    assert resolve(BASE, both).logprobs == 5
    assert resolve(BASE, [("logprobs", 3, "l")]).logprobs == 3  # /v1/completions: an int


def test_response_formats_and_guided_parameters():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shaped = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert response_format("r", shaped) == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": schema},
    }
    assert response_format("r", {"type": "text"}) is None
    assert resolve(BASE, [("guided_choice", ["yes", "no"], "g")]).response_format == {
        "type": "choice",
        "choice": ["yes", "no"],
    }
    assert resolve(BASE, [("guided_regex", "[0-9]+", "g")]).response_format == {
        "type": "regex",
        "regex": "[0-9]+",
    }
    guided_json = resolve(BASE, [("guided_json", '{"type": "object"}', "g")]).response_format
    assert guided_json["json_schema"]["schema"] == {"type": "object"}
    with pytest.raises(RequestError, match="conflicts with body.response_format"):
        resolve(
            BASE,
            [("response_format", {"type": "json_object"}, "body.response_format"),
             ("guided_regex", "a", "body.guided_regex")],
        )  # fmt: skip


def test_engine_params_carry_the_rows_values():
    rng = random.Random()
    row = resolve(BASE, [(k, v, k) for k, v in _random_values(rng).items()])
    params = row.engine_params(seed=123)
    assert params.n == 1 and params.seed == 123
    for name in ("temperature", "top_p", "top_k", "min_p", "max_tokens"):
        assert getattr(params, name) == getattr(row, name)
    assert params.stop == list(row.stop)
    for name in ("presence_penalty", "frequency_penalty", "logprobs", "response_format"):
        assert getattr(params, name) == getattr(row, name)
