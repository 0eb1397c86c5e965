"""FP8 block-scaled and MXFP4 checkpoints: they load as stored, run, and every layer equals
a torch reference that dequantizes the stored tensors with kernels.formats."""

import pytest
import torch

from engine.checkpoint_maker import make_random_checkpoint
from engine.quant.fp8_block import Fp8BlockFormat
from engine.quant.mxfp4 import Mxfp4Format
from kernels.formats.fp8 import dequantize_fp8_block
from kernels.formats.mxfp4 import dequantize_mxfp4
from tests.engine.deepseek_helpers import (
    PagedRunner,
    engine_model_from_hf,
    load_engine_model,
    read_checkpoint,
    relative_error,
)

PROMPT = [256, 5, 9, 100, 7, 8, 41, 42]


def dequantized_state(tensors):
    """Stored tensors -> float32 weights by name (scale tensors folded in)."""
    tensors = dict(tensors)
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale_inv", ".scale")):
            continue
        base = name[: -len(".weight")]
        if f"{base}.weight_scale_inv" in tensors:
            out[name] = dequantize_fp8_block(t, tensors[f"{base}.weight_scale_inv"])
        elif f"{base}.scale" in tensors:
            out[name] = dequantize_mxfp4(t, tensors[f"{base}.scale"])
        else:
            out[name] = t.float()
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    made = {}
    for dense, experts in [("bf16", "bf16"), ("fp8", "fp8"), ("fp8", "mxfp4"), ("bf16", "mxfp4")]:
        made[dense, experts] = make_random_checkpoint(
            root / f"{dense}-{experts}", preset="tiny", dense_dtype=dense, expert_dtype=experts
        )
    return made


@pytest.mark.parametrize("kind", [("fp8", "fp8"), ("fp8", "mxfp4"), ("bf16", "mxfp4")])
def test_quantized_model_equals_dequantized_reference(checkpoints, kind):
    path = checkpoints[kind]
    model = load_engine_model(path)
    formats = {type(m.format) for m in model.modules() if hasattr(m, "format")}
    assert (Fp8BlockFormat in formats) == (kind[0] == "fp8" or kind[1] == "fp8")
    assert (Mxfp4Format in formats) == (kind[1] == "mxfp4")
    # stored, not inflated: FP8 weights are 1 byte, FP4 experts half a byte per value
    experts = model.model.layers[1].mlp.experts.gate_proj
    assert experts.weight.element_size() == 1
    if kind[1] == "mxfp4":
        assert experts.weight.shape[-1] * 2 == experts.in_features

    config, tensors = read_checkpoint(path)
    config = {k: v for k, v in config.items() if k not in ("quantization_config", "expert_dtype")}
    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

    reference = DeepseekV3ForCausalLM(config).eval()
    reference.load_weights(dequantized_state(tensors).items())

    got = PagedRunner(model).step([(0, PROMPT)])[0]
    want = PagedRunner(reference).step([(0, PROMPT)])[0]
    assert relative_error(got, want) < 1e-5


def test_each_layer_matches_the_dequantized_reference(checkpoints):
    model = load_engine_model(checkpoints["fp8", "mxfp4"])
    _, tensors = read_checkpoint(checkpoints["fp8", "mxfp4"])
    stored = dict(tensors)
    gen = torch.Generator().manual_seed(0)
    attn = model.model.layers[1].self_attn
    x = torch.randn(5, attn.kv_b_proj.in_features, generator=gen)
    w = dequantize_fp8_block(
        stored["model.layers.1.self_attn.kv_b_proj.weight"],
        stored["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"],
    )
    assert torch.allclose(attn.kv_b_proj(x), x @ w.T, rtol=1e-5, atol=1e-6)
    moe = model.model.layers[1].mlp
    h = torch.randn(7, 64, generator=gen)
    weights, ids = moe.gate(h)
    ref = torch.zeros_like(h)
    for t in range(h.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])

            def deq(proj, e=e):
                p = f"model.layers.1.mlp.experts.{e}.{proj}"
                return dequantize_mxfp4(stored[f"{p}.weight"], stored[f"{p}.scale"])

            act = torch.nn.functional.silu(h[t] @ deq("gate_proj").T) * (h[t] @ deq("up_proj").T)
            ref[t] += weights[t, k] * (act @ deq("down_proj").T)
    ref += moe.shared_experts(h)
    assert torch.allclose(moe(h), ref, rtol=1e-5, atol=1e-5)


def test_bf16_checkpoint_matches_transformers_loading_the_same_files(checkpoints):
    from transformers import DeepseekV3ForCausalLM as HF

    path = checkpoints["bf16", "bf16"]
    hf = HF.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    model = load_engine_model(path)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(model).step([(0, PROMPT)])[0]
    assert relative_error(got, want) < 1e-4
    # and the checkpoint's weights round-trip through transformers' stacked layout
    again = engine_model_from_hf(hf)
    assert relative_error(PagedRunner(again).step([(0, PROMPT)])[0], want) < 1e-4


def test_nan_e8m0_scale_is_rejected_at_load_naming_the_tensor(checkpoints):
    config, tensors = read_checkpoint(checkpoints["bf16", "mxfp4"])
    bad = "model.layers.2.mlp.experts.5.down_proj.scale"

    def corrupted():
        for name, t in tensors:
            if name == bad:
                t = t.clone()
                t[3, 0] = 255
            yield name, t

    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(config)
    with pytest.raises(
        ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.scale.*255.*\(3, 0\)"
    ):
        model.load_weights(corrupted())
