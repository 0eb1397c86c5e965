"""Routing statistics per task group, in constant memory, through the engine."""

import torch

from engine import LLM, Request, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint
from engine.routing_stats import RoutingRecorder


def test_decode_steps_are_attributed_to_their_dominant_group():
    rec = RoutingRecorder()
    rec.begin_step(2, is_decode=True, group=7)
    rec.record(1, torch.tensor([[0, 1], [0, 1]]), bytes_per_expert=10)
    rec.begin_step(2, is_decode=True, group=3)
    rec.record(1, torch.tensor([[0, 1], [2, 3]]), bytes_per_expert=10)
    rec.begin_step(2, is_decode=True, group=7)
    rec.record(1, torch.tensor([[4, 5], [4, 6]]), bytes_per_expert=10)
    s = rec.summary()
    assert s["decode"]["layers"][1]["mean_distinct_experts"] == (2 + 4 + 3) / 3
    assert s["decode_by_group"][7]["layers"][1]["mean_distinct_experts"] == 2.5
    assert s["decode_by_group"][3]["expert_bytes_per_step"] == 40


def test_engine_passes_the_batch_group(tmp_path):
    model = make_random_checkpoint(tmp_path / "m", preset="tiny", seed=5)
    llm = LLM(str(model), dtype="float32", max_num_seqs=4)
    assert llm.routing_stats() is None
    assert llm.record_routing(True)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    reqs = [Request(str(i), [3 + i, 4, 5], params, group=i // 4) for i in range(8)]
    assert len(list(llm.stream(reqs))) == 8
    by_group = llm.routing_stats()["decode_by_group"]
    assert set(by_group) == {0, 1}
    assert all(g["steps"] > 0 and g["mean_distinct_experts"] > 0 for g in by_group.values())
