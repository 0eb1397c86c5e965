"""The random-checkpoint maker: presets, official layout, sharding, quantized variants of
the same weights, and the CLI."""

import json

import pytest
import torch
from click.testing import CliRunner

from engine import SamplingParams
from engine.checkpoint_maker import PRESETS, build_config, make_random_checkpoint
from kernels.formats.fp8 import dequantize_fp8_block
from kernels.formats.mxfp4 import dequantize_mxfp4
from tests.engine.deepseek_helpers import read_checkpoint


def test_preset_shapes():
    moon = build_config("moonlight-16b-a3b", None, "bf16", "bf16", True)
    assert (moon["num_hidden_layers"], moon["hidden_size"], moon["vocab_size"]) == (
        27,
        2048,
        163840,
    )
    assert (moon["n_routed_experts"], moon["num_experts_per_tok"], moon["n_shared_experts"]) == (
        64,
        6,
        2,
    )
    assert moon["q_lora_rank"] is None and moon["kv_lora_rank"] == 512
    assert moon["moe_intermediate_size"] == 1408 and moon["intermediate_size"] == 11264
    v3 = build_config("deepseek-v3-671b", 4, "fp8", "mxfp4", True)
    assert v3["num_hidden_layers"] == 4 and v3["first_k_dense_replace"] == 3
    assert v3["quantization_config"]["weight_block_size"] == [128, 128]
    assert v3["expert_dtype"] == "fp4" and v3["rope_scaling"]["factor"] == 40
    assert build_config("deepseek-v3-671b", 2, "bf16", "bf16", True)["first_k_dense_replace"] == 1
    assert set(PRESETS) == {"tiny", "moonlight-16b-a3b", "deepseek-v3-671b"}


def test_layout_shards_and_index(tmp_path):
    path = make_random_checkpoint(tmp_path / "m", preset="tiny", shard_bytes=150_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    config, tensors = read_checkpoint(path)
    tensors = dict(tensors)
    assert set(tensors) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in tensors
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert tensors["model.layers.1.mlp.gate.e_score_correction_bias"].abs().min() > 0
    assert "model.layers.3.eh_proj.weight" in tensors and config["num_nextn_predict_layers"] == 1
    assert (path / "tokenizer.json").exists() and (path / "tokenizer_config.json").exists()
    with pytest.raises(ValueError, match="not empty"):
        make_random_checkpoint(path, preset="tiny")


def test_quantized_checkpoints_hold_the_same_weights(tmp_path):
    _, plain = read_checkpoint(make_random_checkpoint(tmp_path / "a", preset="tiny", seed=5))
    _, quant = read_checkpoint(
        make_random_checkpoint(
            tmp_path / "b", preset="tiny", seed=5, dense_dtype="fp8", expert_dtype="mxfp4"
        )
    )
    plain, quant = dict(plain), dict(quant)
    name = "model.layers.1.self_attn.kv_b_proj"
    w = dequantize_fp8_block(quant[f"{name}.weight"], quant[f"{name}.weight_scale_inv"])
    ref = plain[f"{name}.weight"].float()
    assert (w - ref).abs().max() <= ref.abs().max() * 2**-4
    name = "model.layers.2.mlp.experts.3.up_proj"
    w = dequantize_mxfp4(quant[f"{name}.weight"], quant[f"{name}.scale"])
    ref = plain[f"{name}.weight"].float()
    assert (w - ref).abs().max() <= ref.abs().max() / 3 + 0.02
    assert torch.corrcoef(torch.stack((w.flatten(), ref.flatten())))[0, 1] > 0.97


def test_cli_make_random(tmp_path):
    from batchgen.cli.models import models

    out = tmp_path / "cli"
    result = CliRunner().invoke(
        models, ["make-random", "--preset", "tiny", "--expert-dtype", "mxfp4", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["expert_dtype"] == "fp4"
    bad = CliRunner().invoke(models, ["make-random", "--arch", "gpt2", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "'deepseek_v3', 'deepseek_v4', 'llama'" in bad.output
    bad = CliRunner().invoke(
        models, ["make-random", "--arch", "llama", "--preset", "v4-flash", str(tmp_path / "y")]
    )
    assert bad.exit_code != 0 and "a deepseek_v4 preset" in bad.output


def test_llama_checkpoint_loads_and_holds_the_drawn_scales(tmp_path):
    from engine import LLM

    out = make_random_checkpoint(tmp_path / "llama", arch="llama", layers=3, seed=1, device="cpu")
    config, tensors = read_checkpoint(out)
    tensors = dict(tensors)
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 3
    assert len(tensors) == 1 + 3 * 9 + 2 and all(
        t.dtype == torch.bfloat16 for t in tensors.values()
    )
    q = tensors["model.layers.2.self_attn.q_proj.weight"].float()  # N(0, 1/64)
    assert q.shape == (64, 64) and abs(q.std().item() * 8 - 1) < 0.1
    k = tensors["model.layers.0.self_attn.k_proj.weight"]
    assert k.shape == (32, 64)  # 2 KV heads of 16
    norm = tensors["model.norm.weight"].float()
    assert abs(norm.mean().item() - 1) < 0.05 and 0.05 < norm.std().item() < 0.15
    llm = LLM(str(out), dtype="float32", device="cpu")
    assert len(llm.generate("hi", SamplingParams(max_tokens=3))[0].outputs[0].token_ids) == 3
