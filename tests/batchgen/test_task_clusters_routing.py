"""`batchgen bench routing` on a tiny random DeepSeek-V3 checkpoint: both orders decode the
same tokens, the planned order is the planner's, and the JSON carries the comparison."""

from __future__ import annotations

import json

import polars as pl
from click.testing import CliRunner

from batchgen.bench.routing import planned_order
from batchgen.cli import main
from tests.clustering.mixed_tasks import mixed_task_rows


def test_planned_order_is_cluster_by_cluster(tmp_path):
    tokens = [[1] * n for n in (5, 9, 2, 7, 3, 8)]
    clusters = [1, 0, 1, 0, 0, None]
    order = planned_order(tokens, clusters, window=8, spill_dir=tmp_path / "plan")
    assert order == [1, 3, 4, 0, 2, 5]  # cluster 0 (3 rows) longest first, then 1, then none


def test_routing_bench_on_a_tiny_random_moe(tmp_path, monkeypatch):
    from engine.checkpoint_maker import make_random_checkpoint

    model = make_random_checkpoint(tmp_path / "tiny-ds", preset="tiny", device="cpu")
    prompts = tmp_path / "prompts.parquet"
    pl.DataFrame(mixed_task_rows(per_task=8, tasks=3)).write_parquet(prompts)
    monkeypatch.setenv("BATCHGEN_BENCH_DIR", str(tmp_path / "bench"))
    monkeypatch.setattr("batchgen.bench.common.BENCH_DIR", tmp_path / "bench")
    args = ["bench", "routing", "--model", str(model), "--input", str(prompts)]
    args += ["--batch", "8", "--max-tokens", "3", "--device", "cpu", "--name", "routing-test"]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "bench" / "routing-test.json").read_text())
    arrival, planned = payload["arrival"], payload["planned"]
    assert payload["prompts"] == 24
    assert arrival["completion_tokens"] == planned["completion_tokens"] == 24 * 3
    for run in (arrival, planned):
        # Tiny preset: 8 routed experts, top-2, two MoE layers (layer 0 is dense).
        assert set(run["per_layer"]) == {"1", "2"}
        assert 2 <= run["mean_distinct_experts_per_layer"] <= 8
        assert run["decode_steps"] > 0
    expected = (
        1 - planned["mean_distinct_experts_per_layer"] / arrival["mean_distinct_experts_per_layer"]
    )
    assert abs(payload["reduction"]["distinct_experts_per_layer"] - expected) < 1e-3
    assert "distinct experts / layer / step" in result.output
