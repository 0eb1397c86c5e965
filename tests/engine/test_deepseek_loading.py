"""Strict loading: missing and unexpected tensors are named; MTP on/off/auto; stored dtype
mismatches are refused."""

import pytest

from engine.checkpoint_maker import make_random_checkpoint
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.weights import CheckpointMismatch
from tests.engine.deepseek_helpers import read_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_random_checkpoint(tmp_path_factory.mktemp("load") / "tiny", preset="tiny")


def load(path, drop=(), add=(), **kwargs):
    config, tensors = read_checkpoint(path)
    model = DeepseekV3ForCausalLM(config, **kwargs)
    model.load_weights([(n, t) for n, t in tensors if n not in drop] + list(add))
    return model


def test_missing_expert_tensor_is_named(tiny):
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    with pytest.raises(CheckpointMismatch, match=r"missing tensors: " + name.replace(".", r"\.")):
        load(tiny, drop=[name])


def test_missing_mtp_expert_tensor_is_named(tiny):
    name = "model.layers.3.mlp.experts.0.down_proj.weight"
    with pytest.raises(CheckpointMismatch, match=name.replace(".", r"\.")):
        load(tiny, drop=[name])


def test_unexpected_tensors_are_named(tiny):
    import torch

    extra = [
        ("model.layers.1.mlp.experts.0.gate_proj.bias", torch.zeros(32)),
        ("model.layers.1.mlp.experts.8.gate_proj.weight", torch.zeros(32, 64)),
        ("model.layers.0.self_attn.rotary.weight", torch.zeros(4)),
    ]
    with pytest.raises(CheckpointMismatch) as err:
        load(tiny, add=extra)
    for name, _ in extra:
        assert name in str(err.value)


def test_mtp_auto_on_off(tiny):
    assert load(tiny).num_mtp_layers == 1
    off = load(tiny, enable_mtp=False)
    assert off.num_mtp_layers == 0 and len(off.cache_specs()) == 3
    mtp_names = [n for n, _ in read_checkpoint(tiny)[1] if n.startswith("model.layers.3.")]
    # a checkpoint without the MTP layer (what save_pretrained writes) loads without it ...
    assert load(tiny, drop=mtp_names).num_mtp_layers == 0
    # ... unless MTP is required
    with pytest.raises(CheckpointMismatch, match=r"model\.layers\.3\.enorm\.weight"):
        load(tiny, drop=mtp_names, enable_mtp=True)


def test_quantized_tensor_into_float_model_is_refused(tmp_path):
    path = make_random_checkpoint(tmp_path / "fp8", preset="tiny", dense_dtype="fp8")
    config, tensors = read_checkpoint(path)
    del config["quantization_config"]
    model = DeepseekV3ForCausalLM(config)
    with pytest.raises(CheckpointMismatch, match=r"float8_e4m3fn"):
        model.load_weights(tensors)


def test_unsupported_quant_method_is_named(tiny):
    config, _ = read_checkpoint(tiny)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match=r"quant_method 'gptq'"):
        DeepseekV3ForCausalLM(config)
