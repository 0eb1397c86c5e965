"""A DeepSeek-V4 checkpoint in the hub's formats (FP8 E4M3 linears with E8M0 block
scales, MXFP4 experts as int8 nibble pairs with E8M0 scales per 32 inputs) loads with its
weights kept in those formats and gives transformers' logits on the dequantized weights;
the decode-state sizes at V4-Flash's real shapes are the ones MODELS.md counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.models.deepseek_v4_config import DeepseekV4ModelConfig
from engine.models.deepseek_v4_names import E8M0, FP8, hf_state_from_hub, hub_tensor_specs
from kernels.formats.fp8 import dequantize_fp8_block, quantize_fp8_block
from kernels.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from tests.engine.deepseek_helpers import PagedRunner, relative_error
from tests.engine.test_v4_parity import PROMPTS, check_against, run_schedule
from tests.engine.v4_helpers import hf_v4_model

pytest.importorskip("transformers.models.deepseek_v4")

QUANTIZATION = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}
FLASH_CONFIG = Path(__file__).parent / "data" / "deepseek-v4-flash-config.json"


def quantized_hub_state(hf, expert_dtype: str):
    """(the hub state in the hub's formats, the float state those formats decode to)."""
    from engine.models.deepseek_v4_names import hub_state_from_hf

    config = {**hf.config.to_dict(), "quantization_config": {**QUANTIZATION}}
    config["quantization_config"]["expert_dtype"] = expert_dtype
    cfg = DeepseekV4ModelConfig.from_dict(config)
    float_state = hub_state_from_hf(hf.state_dict(), cfg)
    stored, decoded = {}, {}
    for name, spec in hub_tensor_specs(cfg, dtype=torch.float32, mtp=False).items():
        if name.endswith(".scale"):
            continue
        w = float_state[name].detach()
        scale = name[: -len("weight")] + "scale"
        if spec.dtype == FP8:
            codes, s = quantize_fp8_block(w, "e8m0")
            stored[name], stored[scale] = codes, s.view(E8M0)
            decoded[name] = dequantize_fp8_block(codes, s)
        elif spec.dtype == torch.int8:
            packed, s = quantize_mxfp4(w)
            stored[name], stored[scale] = packed.view(torch.int8), s.view(E8M0)
            decoded[name] = dequantize_mxfp4(packed, s)
        else:
            stored[name] = decoded[name] = w.clone()
    return config, cfg, stored, decoded


@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8"])
def test_fp8_and_mxfp4_checkpoint_matches_transformers_on_dequantized_weights(expert_dtype):
    hf = hf_v4_model(seed=11)
    config, cfg, stored, decoded = quantized_hub_state(hf, expert_dtype)
    assert any(t.dtype == torch.int8 for t in stored.values()) == (expert_dtype == "fp4")
    with torch.no_grad():  # transformers runs the weights the formats decode to
        hf.load_state_dict(hf_state_from_hub(decoded, cfg), strict=True)
    model = DeepseekV4ForCausalLM(config).eval()
    model.load_weights(stored.items())
    # kept as stored: FP8 attention and shared-expert linears, packed experts, float wo_a
    attn = model.layers[1].attn
    assert attn.wq_a.weight.dtype == FP8 and attn.indexer.wq_b.weight.dtype == FP8
    assert attn.wo_a.weight.dtype == torch.float32
    assert attn.compressor.wkv.weight.dtype == torch.float32
    assert model.layers[0].ffn.shared_experts.gate_proj.weight.dtype == FP8
    expert_weight = model.layers[2].ffn.experts.gate_proj.weight
    assert expert_weight.dtype == (torch.uint8 if expert_dtype == "fp4" else FP8)
    tokens, rows = run_schedule(model, PROMPTS, new_tokens=6)
    check_against(hf, tokens, rows, PROMPTS)


def test_a_float_tensor_where_the_config_declares_fp8_is_refused_by_name():
    hf = hf_v4_model(seed=11)
    config, _, stored, decoded = quantized_hub_state(hf, "fp4")
    stored["layers.2.attn.wq_b.weight"] = decoded["layers.2.attn.wq_b.weight"]
    model = DeepseekV4ForCausalLM(config)
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.wq_b\.weight.*float8_e4m3fn"):
        model.load_weights(stored.items())


def test_decode_state_sizes_at_v4_flash_shapes():
    """Per token of context, bf16: 21 CSA layers x (512 + 128) x 2 B / 4 plus 20 HCA
    layers x 512 x 2 B / 128 = 6,880 B (V3: 70,272 B); fixed per sequence: a 128-token
    ring of 512 bf16 per layer (5.4 MiB) and the float32 pooling rows (11.6 MiB); the MTP
    layer (sliding only) adds one more ring."""
    config = json.loads(FLASH_CONFIG.read_text())
    with torch.device("meta"):
        with_mtp = DeepseekV4ForCausalLM(config)
        model = DeepseekV4ForCausalLM(config, enable_mtp=False)
    mtp_state = sum(s.bytes_per_sequence(torch.bfloat16) for s in with_mtp.state_specs())
    own = sum(s.bytes_per_sequence(torch.bfloat16) for s in model.state_specs())
    assert mtp_state - own == 128 * 512 * 2
    per_token = sum(s.bytes_per_token(torch.bfloat16) for s in model.cache_specs())
    assert per_token == 21 * (512 + 128) * 2 / 4 + 20 * 512 * 2 / 128 == 6880
    state = [s.bytes_per_sequence(torch.bfloat16) for s in model.state_specs()]
    rings = 43 * 128 * 512 * 2
    pooling = 20 * (2 * 128 * 512 * 4) + 21 * (2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4)
    assert sum(state) == rings + pooling
    assert round(rings / 2**20, 1) == 5.4 and round(pooling / 2**20, 1) == 11.6
    assert {s.tokens_per_entry for s in model.cache_specs()} == {4, 128}


def test_quantized_and_float_checkpoints_of_one_model_agree():
    """The same weights decoded from the formats, given as float, load into a float model
    that matches the quantized one (the formats are decoded, not approximated, on the CPU)."""
    hf = hf_v4_model(seed=12)
    config, _, stored, decoded = quantized_hub_state(hf, "fp4")
    quant = DeepseekV4ForCausalLM(config).eval()
    quant.load_weights(stored.items())
    plain = DeepseekV4ForCausalLM(hf.config.to_dict()).eval()
    plain.load_weights(decoded.items())
    a = PagedRunner(quant, block_size=8).step([(0, PROMPTS[0])])[0]
    b = PagedRunner(plain, block_size=8).step([(0, PROMPTS[0])])[0]
    assert relative_error(a, b) < 1e-5


def test_transformers_scale_names_in_the_save_pretrained_layout_load_the_same_model():
    """`model.layers.{i}.attn.wq_a.weight` + `...weight_scale_inv` (float32 powers of two,
    transformers' spelling of the hub's E8M0 `.scale`) give the hub checkpoint's model."""
    from engine.models.deepseek_v4_names import to_layout

    hf = hf_v4_model(seed=13)
    config, cfg, stored, _ = quantized_hub_state(hf, "fp4")
    hub = DeepseekV4ForCausalLM(config).eval()
    hub.load_weights(stored.items())
    saved = {}
    for name, tensor in stored.items():
        if name.endswith(".scale"):
            weight = to_layout(name[: -len("scale")] + "weight", "hf_saved", cfg)
            scale = tensor.view(torch.uint8).to(torch.int32)
            saved[weight[: -len(".weight")] + ".weight_scale_inv"] = torch.exp2(scale - 127.0)
        else:
            saved[to_layout(name, "hf_saved", cfg)] = tensor
    model = DeepseekV4ForCausalLM(config).eval()
    model.load_weights(saved.items())
    want = PagedRunner(hub, block_size=8).step([(0, PROMPTS[0])])[0]
    assert torch.equal(PagedRunner(model, block_size=8).step([(0, PROMPTS[0])])[0], want)
    bad = dict(saved)
    name = "model.layers.1.attn.wq_b.weight_scale_inv"
    bad[name] = bad[name] * 1.5
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wq_b\.weight_scale_inv.*powers of two"):
        DeepseekV4ForCausalLM(config).load_weights(bad.items())
