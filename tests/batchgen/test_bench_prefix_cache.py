"""`batchgen bench prefix-cache` on a tiny llama: its counts add up, the texts are the same
on and off, and it imports nothing of the pipeline that the GPU image lacks."""

from __future__ import annotations

import json
import random
import subprocess
import sys

from click.testing import CliRunner

from batchgen.bench.prefix_cache import command
from batchgen.bench.prefix_workloads import distinct_prompt_tokens


def test_distinct_prompt_tokens_counts_the_token_trie():
    rng = random.Random(0)
    prompts = [[rng.randrange(5) for _ in range(rng.randrange(1, 8))] for _ in range(40)]
    trie = {tuple(p[: i + 1]) for p in prompts for i in range(len(p))}
    assert distinct_prompt_tokens(prompts) == len(trie)


def test_the_bench_runs_every_job_and_writes_its_json(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path)
    args = ["--model", str(tiny_model_dir), "--device", "cpu", "--rows", "6",
            "--prefix-tokens", "32", "--suffix-tokens", "3", "--n-prompts", "2", "--n", "3",
            "--new-tokens", "3", "--name", "pc"]  # fmt: skip
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "pc.json").read_text())
    jobs = {r["job"]: r for r in payload["results"]}
    assert set(jobs) == {"shared", "n", "distinct"}
    for r in jobs.values():
        assert r["same_tokens"]
        assert r["off"]["cached_prompt_tokens"] == 0
        assert r["off"]["prompt_tokens_computed"] == r["off"]["prompt_tokens"]
        on = r["on"]
        assert on["prompt_tokens_computed"] + on["cached_prompt_tokens"] == on["prompt_tokens"]
    # 32-token prefix = 2 full blocks of 16: every row after the first computes its suffix
    assert jobs["shared"]["on"]["prompt_tokens_computed"] == 35 + 5 * 3
    assert jobs["distinct"]["on"]["cached_prompt_tokens"] == 0


def test_the_bench_needs_neither_pydantic_nor_gguf():
    code = (
        "import sys\n"
        "import batchgen.bench.prefix_cache\n"
        "print('LOADED', sorted(m for m in ('pydantic', 'gguf', 'polars') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "LOADED []" in out.stdout, out.stdout
