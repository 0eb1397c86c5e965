"""Prefix caching in the pipeline: the planner puts rows sharing a prompt prefix together
(longest shared prefix first), a job gives the same texts with `batching.prefix_caching`
on and off, each result row carries `cached_prompt_tokens`, and report.json / report.md
and the progress line show the hit rate."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import polars as pl
import pytest

from batchgen.job_spec import BatchingSpec, parse_job
from batchgen.planner import plan_rows
from batchgen.prefix_order import shared_prefix_order
from batchgen.progress import Progress
from batchgen.rows import PreparedRow
from batchgen.run import EXIT_OK, run_job
from tests.batchgen.conftest import write_parquet


def _row(i: int, tokens: list[int], group: int | None = None) -> PreparedRow:
    return PreparedRow(seq=i, id=f"r{i}", carry={}, prompt_token_ids=tokens, group=group)


def test_rows_sharing_a_prefix_go_together_longest_shared_prefix_first():
    rng = random.Random(0)
    long_prefix = [rng.randrange(2, 99) for _ in range(60)]
    short_prefix = [rng.randrange(100, 199) for _ in range(20)]
    rows = []
    for i in range(30):
        kind = i % 3
        if kind == 0:
            tokens = long_prefix + [rng.randrange(2, 99) for _ in range(rng.randrange(1, 9))]
        elif kind == 1:
            tokens = short_prefix + [rng.randrange(2, 99) for _ in range(rng.randrange(1, 40))]
        else:
            tokens = [200 + i] + [rng.randrange(2, 99) for _ in range(rng.randrange(1, 70))]
        rows.append(_row(i, tokens))
    rng.shuffle(rows)
    ordered = shared_prefix_order(list(rows))
    assert sorted(r.seq for r in ordered) == list(range(30))
    kinds = [r.seq % 3 for r in ordered]
    assert kinds == [0] * 10 + [1] * 10 + [2] * 10
    alone = [r.num_prompt_tokens for r in ordered[20:]]
    assert alone == sorted(alone, reverse=True)
    # rows sharing fewer tokens than a cache block are not a family
    few = [_row(i, [7] * 15 + [i] * (i + 1)) for i in range(4)]
    assert [r.seq for r in shared_prefix_order(few)] == [3, 2, 1, 0]


@pytest.mark.parametrize("caching", [True, False])
def test_the_planner_keeps_groups_and_orders_inside_them(tmp_path, caching):
    rng = random.Random(1)
    prefix = [rng.randrange(2, 99) for _ in range(40)]
    rows = [
        _row(i, (prefix if i % 2 else [300 + i]) + [rng.randrange(2, 99)] * (1 + i % 7), i % 3)
        for i in range(36)
    ]
    spec = BatchingSpec(cluster="auto", plan_window=12, prefix_caching=caching)
    planned = list(plan_rows(iter(rows), spec, tmp_path / "plan"))
    assert sorted(r.seq for r in planned) == list(range(36))
    assert [r.group for r in planned] == [0] * 12 + [1] * 12 + [2] * 12
    for g in range(3):
        group = planned[12 * g : 12 * (g + 1)]
        if caching:  # the sharers first, together
            assert [r.seq % 2 for r in group] == [1] * 6 + [0] * 6
        else:
            lengths = [r.num_prompt_tokens for r in group]
            assert lengths == sorted(lengths, reverse=True)


class _Lines(io.StringIO):
    def isatty(self):
        return False


def _job(model: Path, data: Path, out: Path, caching: bool) -> dict:
    instruction = "Translate the following sentence into French. " * 6
    return {
        "input": {"path": str(data)},
        "prompt": {"template": instruction + "\n{{ text }}"},
        "model": {"path": str(model)},
        "sampling": {"temperature": 0.9, "top_p": 0.95, "max_tokens": 6, "seed": 5, "n": 2},
        "batching": {
            "cluster": "lang",
            "max_num_seqs": 4,
            "max_num_batched_tokens": 48,
            "prefix_caching": caching,
        },
        "output": {"path": str(out), "rows_per_part": 5},
    }


def test_a_job_gives_the_same_texts_with_caching_on_and_off(tiny_model_dir, tmp_path):
    rows = [
        {
            "id": f"r{i:03d}",
            "text": f"item {i} ships on day {i % 5}",
            "lang": "fr" if i % 3 else "de",
        }
        for i in range(14)
    ]
    data = write_parquet(tmp_path / "in.parquet", rows)
    frames, lines = {}, {}
    for caching in (True, False):
        out = tmp_path / f"run-{caching}"
        stream = _Lines()
        progress = Progress(None, tty=False, interval=0, stream=stream)
        job = parse_job(_job(tiny_model_dir, data, out, caching))
        assert run_job(job, "job.yaml", progress=progress).exit_code == EXIT_OK
        frames[caching] = pl.read_parquet(out / "results" / "*.parquet").sort("id", "n_index")
        lines[caching] = [json.loads(x)["progress"] for x in stream.getvalue().splitlines()]
        report = json.loads((out / "report.json").read_text())
        md = (out / "report.md").read_text()
        cache = report["prefix_cache"]
        df = frames[caching]
        assert df.schema["cached_prompt_tokens"] == pl.Int32
        assert cache["cached_prompt_tokens"] == df["cached_prompt_tokens"].sum()
        assert cache["prefilled_prompt_tokens"] == df["prompt_tokens"].sum()
        assert set(report["clusters"]) == {"0", "1"}
        last = lines[caching][-1]
        assert last["cached_prompt_tokens"] == cache["cached_prompt_tokens"]
        if caching:
            assert 0.5 < cache["hit_rate"] < 1
            assert all(0 < c["prefix_cache_hit_rate"] < 1 for c in report["clusters"].values())
            assert (
                "prompt tokens read from the prefix cache" in md
                and f"{cache['hit_rate']:.1%}" in md
            )
            assert (df["cached_prompt_tokens"] < df["prompt_tokens"]).all()
            assert last["prefix_cache_hit_rate"] == pytest.approx(cache["hit_rate"], abs=1e-4)
        else:
            assert cache["hit_rate"] == 0 and (df["cached_prompt_tokens"] == 0).all()
    on, off = frames[True], frames[False]
    assert on["text"].to_list() == off["text"].to_list()
    assert on["id"].to_list() == off["id"].to_list() and len(on) == 28


def test_blocks_run_elsewhere_count_their_cached_prompt_tokens():
    """A Ray worker's block reaches the driver's progress line with its cache hits."""
    from batchgen.stats import RunStats

    stats = RunStats(rows_total=4, n=1)
    stats.record_block(4, 4, 0, 400, 40, {"length": 4}, 400, 300)
    snapshot = stats.snapshot()
    assert snapshot["cached_prompt_tokens"] == 300
    assert snapshot["prefix_cache_hit_rate"] == 0.75
