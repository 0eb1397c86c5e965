"""The job file is parsed strictly and safely: every value in its own type (no `true` taken
as 1, no "4" as 4), YAML aliases bounded (a "billion laughs" file is refused at once), and
no message that formats an unbounded value."""

from __future__ import annotations

import time
import tracemalloc
from typing import get_args

import pytest

from batchgen.job_spec import (
    MAX_YAML_NODES,
    JobError,
    JobSpec,
    load_job,
    load_yaml,
    parse_job,
)

BASE = {
    "input": {"path": "in.parquet"},
    "prompt": {"template": "{{ text }}"},
    "output": {"path": "run"},
}
# Every numeric and boolean field of every section, with its kind.
FIELDS = [
    ("input", "batch_rows", int),
    ("prompt", "chat", bool),
    ("model", "kv_cache_memory", int),
    ("model", "max_model_len", int),
    ("model", "record_routing", bool),
    ("sampling", "n", int),
    ("sampling", "temperature", float),
    ("sampling", "top_p", float),
    ("sampling", "top_k", int),
    ("sampling", "min_p", float),
    ("sampling", "max_tokens", int),
    ("sampling", "seed", int),
    ("sampling", "presence_penalty", float),
    ("sampling", "frequency_penalty", float),
    ("sampling", "logprobs", bool),
    ("sampling", "top_logprobs", int),
    ("sampling", "json_whitespace", bool),
    ("batching", "num_clusters", int),
    ("batching", "max_num_seqs", int),
    ("batching", "max_num_batched_tokens", int),
    ("batching", "plan_window", int),
    ("batching", "batch_invariant", bool),
    ("batching", "prefix_caching", bool),
    ("output", "rows_per_part", int),
    ("errors", "budget", float),
    ("executor", "num_workers", int),
    ("executor", "resources_per_worker", dict),
]
WRONG = {
    int: [True, "4", 4.0, [4]],
    float: [True, "0.5", "1e-3"],
    bool: [1, "true", "yes", 0.0],
    dict: [True, "GPU: 1", [1]],
}


def _job(section: str, key: str, value) -> dict:
    job = {name: dict(body) for name, body in BASE.items()}
    job.setdefault(section, {})[key] = value
    return job


def test_fields_cover_every_numeric_and_boolean_key():
    sections = JobSpec.model_fields
    seen = set()
    for name, info in sections.items():
        # An optional section (prompt) is `Spec | None`: its fields are the Spec's.
        section = next(
            a for a in get_args(info.annotation) or [info.annotation] if a is not type(None)
        )
        for key, field in section.model_fields.items():
            text = str(field.annotation)
            if any(t in text for t in ("int", "float", "bool")):
                seen.add((name, key))
    assert seen == {(s, k) for s, k, _ in FIELDS}


@pytest.mark.parametrize(
    "section, key, value",
    [(s, k, v) for s, k, kind in FIELDS for v in WRONG[kind]],
)
def test_wrong_types_are_refused_naming_the_key(section, key, value):
    with pytest.raises(JobError) as exc:
        parse_job(_job(section, key, value))
    message = str(exc.value)
    assert f"'{section}.{key}'" in message
    assert type(value).__name__ in message  # says what it got


@pytest.mark.parametrize("key", ["temperature", "top_p", "min_p"])
def test_float_fields_take_integers(key):
    job = parse_job(_job("sampling", key, 1))
    assert getattr(job.sampling, key) == 1.0
    assert parse_job(_job("errors", "budget", 0)).errors.budget == 0.0


def test_right_types_still_parse():
    job = parse_job(
        {
            **BASE,
            "sampling": {"max_tokens": 4, "temperature": 0.7, "seed": 3, "stop": "END"},
            "prompt": {"template": "{{ text }}", "chat": False},
            "model": {"record_routing": True, "max_model_len": 512},
        }
    )
    assert job.sampling.max_tokens == 4 and job.sampling.stop == ["END"]
    assert job.prompt.chat is False and job.model.record_routing is True


BILLION_LAUGHS = "".join(
    [
        '- &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
        *(
            f"- &{cur} [{','.join(['*' + prev] * 9)}]\n"
            for prev, cur in zip("abcdefgh", "bcdefghi", strict=True)
        ),
    ]
)


def test_billion_laughs_is_refused_at_once(tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(BILLION_LAUGHS)
    assert path.stat().st_size == 333  # the file of the issue: 9 ** 9 "lol"s
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(JobError) as exc:
        load_job(path)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert elapsed < 5 and peak < 100 * 2**20, (elapsed, peak)
    message = str(exc.value)
    assert str(path) in message and f"more than {MAX_YAML_NODES:,} YAML nodes" in message
    assert "\n" not in message and len(message) < 500


def test_one_level_more_is_refused_as_fast(tmp_path):
    path = tmp_path / "lol10.yaml"
    path.write_text(BILLION_LAUGHS + f"- &j [{','.join(['*i'] * 9)}]\n")
    start = time.perf_counter()
    with pytest.raises(JobError, match="YAML nodes"):
        load_job(path)
    assert time.perf_counter() - start < 5


def test_aliases_within_the_bound_work_and_recursive_ones_are_refused(tmp_path):
    assert load_yaml("stop: &s [END, STOP]\nagain: *s\n") == {
        "stop": ["END", "STOP"],
        "again": ["END", "STOP"],
    }
    path = tmp_path / "recursive.yaml"
    path.write_text("input: &x {path: [*x]}\n")
    with pytest.raises(JobError, match="recursive"):
        load_job(path)


def test_messages_never_format_a_huge_value():
    shared = ["lol"] * 1000
    for _ in range(5):
        shared = [shared] * 1000  # 10**18 items if expanded
    start = time.perf_counter()
    with pytest.raises(JobError) as exc:
        parse_job(shared)
    assert time.perf_counter() - start < 5
    assert "mapping of sections" in str(exc.value) and len(str(exc.value)) < 300

    job = _job("sampling", "stop", shared)
    with pytest.raises(JobError) as exc:
        parse_job(job)
    assert "sampling.stop" in str(exc.value) and len(str(exc.value)) < 2000


def test_oversized_or_binary_job_files_are_refused(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("prompt:\n  template: '" + "x" * (2 << 20) + "'\n")
    with pytest.raises(JobError, match="bytes"):
        load_job(big)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"input: {path: \xff\xfe}\n")
    with pytest.raises(JobError, match="not UTF-8"):
        load_job(binary)


def test_cluster_off_unquoted_in_yaml_reads_as_off_and_on_is_refused_by_name():
    import yaml

    from batchgen.job_spec import JobError, parse_job

    def job(value: str) -> dict:
        text = (
            "input: {path: x.parquet}\nprompt: {template: 'x {{ text }}'}\nmodel: {path: m}\n"
            f"output: {{path: out}}\nbatching: {{cluster: {value}}}\n"
        )
        return yaml.safe_load(text)

    assert parse_job(job("off")).batching.cluster == "off"
    assert parse_job(job('"off"')).batching.cluster == "off"
    with pytest.raises(JobError, match="batching.cluster: true; write auto, off"):
        parse_job(job("on"))
