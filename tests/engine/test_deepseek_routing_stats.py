"""RoutingRecorder: off by default, per-layer distinct experts and bytes per step."""

import pytest
import torch

from engine.routing_stats import RoutingRecorder
from tests.engine.deepseek_helpers import PagedRunner, engine_model_from_hf, hf_model


def test_recorder_counts_distinct_experts_and_bytes():
    rec = RoutingRecorder()
    rec.begin_step(3, is_decode=False)
    rec.record(1, torch.tensor([[0, 1], [1, 2], [0, 2]]), bytes_per_expert=100)
    rec.record(2, torch.tensor([[5, 6], [5, 6], [5, 6]]), bytes_per_expert=100)
    rec.begin_step(1, is_decode=True)
    rec.record(1, torch.tensor([[3, 4]]), bytes_per_expert=100)
    s = rec.summary()
    assert s["steps"] == 2 and s["tokens"] == 4
    assert s["all"]["layers"][1] == {"mean_distinct_experts": 2.5, "mean_expert_bytes": 250.0}
    assert s["prefill"]["layers"][2]["mean_distinct_experts"] == 2
    assert s["decode"]["expert_bytes_per_step"] == 200.0
    rec.reset()
    assert rec.summary()["steps"] == 0
    with pytest.raises(RuntimeError, match="begin_step"):
        rec.record(1, torch.tensor([[0, 1]]), 1)


def test_model_records_only_when_a_recorder_is_set():
    model = engine_model_from_hf(hf_model(seed=4))
    assert model.routing_recorder is None
    runner = PagedRunner(model)
    runner.step([(0, [1, 2, 3, 4])])  # off: nothing to record into, no error
    rec = RoutingRecorder()
    model.routing_recorder = rec
    rec.begin_step(4, is_decode=False)
    runner.step([(1, [5, 6, 7, 8])])
    layers = rec.summary()["all"]["layers"]
    assert sorted(layers) == [1, 2]  # tiny config: layer 0 is dense
    expert_bytes = 3 * 64 * 32 * 4  # gate, up, down of one float32 expert
    for stats in layers.values():
        assert 2 <= stats["mean_distinct_experts"] <= 8
        assert stats["mean_expert_bytes"] == stats["mean_distinct_experts"] * expert_bytes
    model.routing_recorder = None
    assert all(m.routing_recorder is None for m in model.modules() if hasattr(m, "gate"))
