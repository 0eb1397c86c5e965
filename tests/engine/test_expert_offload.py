"""Routed experts split between the device and the host (issue 24's placement and
split/combine, on the CPU: the "device" experts run the torch path, the host ones the
numba kernel). In float32 a split model gives the all-device model's greedy tokens and its
logits within float32 rounding (the host kernel's exact mode); bf16 models keep the fast
int8 mode; host experts are loaded in their stored format only; a row's output does not
depend on its batch; bad placements are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint
from engine.expert_placement import (
    ExpertPlacement,
    MoeLayerShape,
    load_placement,
    load_route_counts,
    plan_auto,
)
from engine.layers.host_experts import HostExpertStore
from engine.layers.moe import DeepseekMoE
from tests.engine.deepseek_helpers import PagedRunner

PROMPTS = [[3, 17, 42, 5, 9, 11, 60, 2], [7, 70, 77], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]


def _moe_layers(llm: LLM) -> list[DeepseekMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, DeepseekMoE)]


def _half_on_host(llm: LLM, path) -> ExpertPlacement:
    """Every MoE layer's odd experts on the host (layers with hash routing included)."""
    host = {m.layer_index: tuple(range(1, m.experts.num_experts, 2)) for m in _moe_layers(llm)}
    placement = ExpertPlacement(host)
    placement.save(path)
    return placement


def _prompt_logits(llm: LLM, prompts) -> list[torch.Tensor]:
    """Each prompt's logits [len, V] from one forward (binds fresh caches to the model)."""
    runner = PagedRunner(llm.engine.runner.model)
    return [runner.step([(i, p)])[0] for i, p in enumerate(prompts)]


def _greedy(llm: LLM, prompts, max_tokens=16):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module", params=["deepseek_v4-mxfp4", "deepseek_v3-fp8"])
def checkpoint(request, tmp_path_factory):
    arch, experts = request.param.split("-")
    path = tmp_path_factory.mktemp(arch) / "model"
    make_random_checkpoint(path, arch=arch, preset="tiny", dense_dtype="fp8",
                           expert_dtype=experts, device="cpu", mtp=False)  # fmt: skip
    return path, experts


def test_split_model_matches_all_device(checkpoint, tmp_path):
    path, experts = checkpoint
    full = LLM(str(path), dtype="float32")
    placement = _half_on_host(full, tmp_path / "placement.json")
    split = LLM(str(path), dtype="float32", expert_offload=str(tmp_path / "placement.json"))

    for moe in _moe_layers(split):
        on_host = placement.host_experts(moe.layer_index)
        store = moe.experts.host
        assert store is not None and store.expert_ids == on_host and not store.missing()
        # device tensors hold the device experts only; the host holds its stored bytes
        device_count = moe.experts.num_experts - len(on_host)
        assert moe.experts.gate_proj.weight.shape[0] == device_count
        assert store.nbytes == len(on_host) * moe.experts.bytes_per_expert()
    summary = split.expert_placement
    assert summary["experts_on_host"] == sum(len(v) for v in placement.host.values())
    assert full.expert_placement is None

    # a float32 model: MXFP4 host experts take float32 activations (the exact mode)
    if experts == "mxfp4":
        assert all(m.experts.host.kernel_store.float32_activations for m in _moe_layers(split))
    assert _greedy(split, PROMPTS) == _greedy(full, PROMPTS)
    # each MoE layer alone on the same input: only the float32 order of the dots differs
    x = torch.randn(5, _moe_layers(full)[0].experts.gate_proj.in_features)
    for a, b in zip(_moe_layers(full), _moe_layers(split), strict=True):
        token_ids = torch.arange(5) if a.gate.tid2eid is not None else None
        ya, yb = a(x, token_ids), b(x, token_ids)
        assert float((ya - yb).norm() / ya.norm()) < 1e-5, a.layer_index
    for la, lb in zip(_prompt_logits(full, PROMPTS), _prompt_logits(split, PROMPTS), strict=True):
        assert float((la - lb).norm() / la.norm()) < 1e-5


@pytest.mark.parametrize("dtype,exact", [(torch.float32, True), (torch.bfloat16, False)])
def test_the_host_mode_follows_the_models_dtype(dtype, exact):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        store = HostExpertStore((1, 3), 4, 64, 32, "mxfp4", "layers.1.mlp.experts")
    finally:
        torch.set_default_dtype(saved)
    assert store.compute_dtype == dtype
    # float32 models: float32 activations; bf16 models: the fast int8 mode
    assert store.kernel_store.float32_activations is exact


def test_split_rows_do_not_depend_on_their_batch(checkpoint, tmp_path):
    path, _ = checkpoint
    full = LLM(str(path), dtype="float32")
    _half_on_host(full, tmp_path / "placement.json")
    split = LLM(str(path), dtype="float32", expert_offload=str(tmp_path / "placement.json"))
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in split.generate(PROMPTS, params)]
    alone = [split.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_plan_auto_fills_the_budget_by_route_share():
    layers = [MoeLayerShape(1, 4, 100), MoeLayerShape(2, 4, 100)]
    routes = {1: [0, 10, 0, 90], 2: [50, 50, 0, 0]}
    placement = plan_auto(layers, device_budget=350, routes=routes)
    # the three most routed (layer 1 expert 3: 0.9, layer 2 experts 0 and 1: 0.5 each) fit
    assert placement.host == {1: (0, 1, 2), 2: (2, 3)}
    summary = placement.summary(layers, routes)
    assert summary["experts_on_device"] == 3 and summary["experts_on_host"] == 5
    assert summary["expected_host_route_share"] == pytest.approx(10 / 200)
    # no statistics: the lowest ids of every layer first
    assert plan_auto(layers, device_budget=400).host == {1: (2, 3), 2: (2, 3)}
    assert plan_auto(layers, device_budget=10_000).host == {}


def test_placement_files_are_checked(tmp_path, checkpoint):
    path, _ = checkpoint
    bad = tmp_path / "bad.json"
    for blob, needle in [
        ("{not json", "not valid JSON"),
        (json.dumps({"version": 2, "host": {}}), "version"),
        (json.dumps({"version": 1, "host": {"x": [1]}}), "layer key 'x'"),
        (json.dumps({"version": 1, "host": {"1": [1, 1]}}), "distinct expert ids"),
    ]:
        bad.write_text(blob)
        with pytest.raises(ValueError, match=needle):
            load_placement(bad)
    bad.write_text(json.dumps({"version": 1, "host": {"999": [0]}}))
    with pytest.raises(ValueError, match="layer 999 is not a MoE layer"):
        LLM(str(path), dtype="float32", expert_offload=str(bad))
    bad.write_text(json.dumps({"version": 1, "host": {"1": [0, 500]}}))
    with pytest.raises(ValueError, match=r"names experts \[500\]"):
        LLM(str(path), dtype="float32", expert_offload=str(bad))
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"nothing": 1}))
    with pytest.raises(ValueError, match="expert_routes"):
        load_route_counts(stats)


def test_auto_on_a_cpu_places_everything_on_the_device(checkpoint):
    path, _ = checkpoint
    llm = LLM(str(path), dtype="float32", expert_offload="auto")
    assert llm.expert_placement is None
    assert all(m.experts.host is None for m in _moe_layers(llm))


def test_unquantized_experts_cannot_go_to_the_host(tmp_path):
    path = make_random_checkpoint(tmp_path / "bf16", arch="deepseek_v3", preset="tiny",
                                  device="cpu", mtp=False)  # fmt: skip
    ExpertPlacement({1: (0,)}).save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="expert offload needs MXFP4 or FP8 experts"):
        LLM(str(path), dtype="float32", expert_offload=str(tmp_path / "p.json"))
