"""GGUF loading: metadata -> config, names, q/k row order, block dequantization, and the
kept-small formats, against gguf-py and transformers' own GGUF loader on a tiny file."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from engine.layers.linear import Linear
from engine.loader import open_model_source
from engine.loader.gguf_source import hf_name, unpermute_rope_rows
from engine.quant.gguf import GGUFBlockFormat, GGUFQuantConfig
from kernels.cpu.quant_matmul import int4_kernel_available

Q = GGMLQuantizationType
TINY = dict(vocab=96, hidden=64, heads=4, kv_heads=2, inter=128, layers=2)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (written from its description: each
    head's rows go from (half, i) to (i, half) order)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def hf_tensors(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """Random Hugging Face llama weights of the TINY shape, [out, in] float32."""
    rng = np.random.default_rng(seed)
    h, i, v = TINY["hidden"], TINY["inter"], TINY["vocab"]
    hd = h // TINY["heads"]

    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    out = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": 1 + w(h)}
    if not tied:
        out["lm_head.weight"] = w(v, h)
    for n in range(TINY["layers"]):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": 1 + w(h),
            p + "post_attention_layernorm.weight": 1 + w(h),
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.k_proj.weight": w(TINY["kv_heads"] * hd, h),
            p + "self_attn.v_proj.weight": w(TINY["kv_heads"] * hd, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
        }
    return out


GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def to_gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, layer, *rest = name.split(".")
    return f"blk.{layer}.{GGUF_NAMES['.'.join(rest[:-1])]}.weight"


def default_types(name: str) -> GGMLQuantizationType:
    """A mix that covers every supported type."""
    if name.endswith("post_attention_layernorm.weight"):
        return Q.BF16
    if name.endswith("norm.weight"):
        return Q.F32
    if "embed_tokens" in name or "lm_head" in name:
        return Q.Q8_0
    if "self_attn.q_proj" in name or "self_attn.k_proj" in name:
        return Q.Q4_0
    if "self_attn.v_proj" in name:
        return Q.Q8_0
    if "self_attn.o_proj" in name:
        return Q.F16
    return Q.Q4_1


def write_tiny_gguf(path: Path, tensors: dict[str, np.ndarray], types=default_types) -> Path:
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(TINY["hidden"])
    writer.add_feed_forward_length(TINY["inter"])
    writer.add_head_count(TINY["heads"])
    writer.add_head_count_kv(TINY["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(TINY["vocab"])
    writer.add_rope_dimension_count(TINY["hidden"] // TINY["heads"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, w in tensors.items():
        if "q_proj" in name:
            w = llama_cpp_permute(w, TINY["heads"])
        elif "k_proj" in name:
            w = llama_cpp_permute(w, TINY["kv_heads"])
        qtype = types(name)
        data = quantize(w, qtype)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(to_gguf_name(name), data)
        else:
            writer.add_tensor(to_gguf_name(name), data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantized_like_gguf_py(tensors, types=default_types) -> dict[str, torch.Tensor]:
    """What the file holds, dequantized by gguf-py, in Hugging Face row order."""
    out = {}
    for name, w in tensors.items():
        qtype = types(name)
        out[name] = torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape).copy())
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    tensors = hf_tensors()
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tensors)
    return path, tensors


def test_config_from_metadata(tiny):
    path, _ = tiny
    cfg = open_model_source(str(path), dtype=torch.float32).config
    assert cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 16 and cfg["intermediate_size"] == 128
    assert cfg["vocab_size"] == 96 and cfg["max_position_embeddings"] == 256
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_float32_matches_gguf_py_dequantize_in_hf_order(tiny):
    path, tensors = tiny
    expected = dequantized_like_gguf_py(tensors)
    got = dict(open_model_source(str(path), dtype=torch.float32).iter_weights())
    assert set(got) == set(expected)
    for name, w in expected.items():
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], w, rtol=0, atol=0, msg=name)


def test_float32_matches_transformers_gguf_loader(tiny):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    path, _ = tiny
    logging.getLogger("transformers").setLevel(logging.ERROR)
    ref = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    got = dict(open_model_source(str(path), dtype=torch.float32).iter_weights())
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, ref[name], rtol=0, atol=0, msg=name)
    assert {n for n in ref if n != "lm_head.weight"} == set(got)  # tied head: no copy


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(1).standard_normal((48, 8)).astype(np.float32)
    for heads in (1, 2, 3, 6):
        back = unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))
        assert not torch.equal(torch.from_numpy(llama_cpp_permute(w, 2)), torch.from_numpy(w))


def test_auto_dtype_keeps_blocks(tiny):
    path, tensors = tiny
    src = open_model_source(str(path))
    assert src.config["tie_word_embeddings"] is True
    assert isinstance(src.quant_config, GGUFQuantConfig)
    got = dict(src.iter_weights())
    assert "lm_head.weight" not in got
    assert got["model.embed_tokens.weight"].dtype == torch.float32  # for the lookup
    assert got["model.layers.0.mlp.up_proj.weight"].shape == (128, 64 // 32 * 20)
    assert got["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64 // 32 * 18)
    assert got["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float16
    fmt = src.quant_config.format_for("model.layers.0.self_attn.o_proj", 64, 64)
    assert not isinstance(fmt, GGUFBlockFormat)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    path = tmp_path_factory.mktemp("untied") / "untied.gguf"
    return write_tiny_gguf(path, hf_tensors(seed=4, tied=False))


@pytest.mark.parametrize(
    "prefix",
    [
        "lm_head",  # Q8_0, kept float after loading
        "model.layers.1.self_attn.q_proj",  # Q4_0, permuted rows
        "model.layers.1.self_attn.k_proj",  # Q4_0, 32 rows
        "model.layers.0.self_attn.v_proj",  # Q8_0
        "model.layers.0.mlp.down_proj",  # Q4_1
    ],
)
def test_block_linear_layers_compute_the_file_weights(untied, prefix):
    src = open_model_source(str(untied))
    raw = dict(src.iter_weights())[prefix + ".weight"]
    assert raw.dtype == torch.uint8
    w = dict(open_model_source(str(untied), dtype=torch.float32).iter_weights())[prefix + ".weight"]
    out_f, in_f = w.shape
    layer = Linear(in_f, out_f, quant_config=src.quant_config, prefix=prefix)
    assert isinstance(layer.format, GGUFBlockFormat)
    layer.weight.data.copy_(raw)
    torch.testing.assert_close(layer.format.dequantize(layer), w, rtol=0, atol=0)
    layer.process_weights_after_loading()
    x = torch.randn(5, in_f, generator=torch.Generator().manual_seed(3))
    if prefix == "lm_head":  # float logits: exact
        assert layer.int4 is None and layer.weight.dtype == torch.float32
        torch.testing.assert_close(layer.format.dequantize(layer), w, rtol=0, atol=0)
        torch.testing.assert_close(layer(x), x @ w.t())
        return
    assert (layer.int4 is not None) == int4_kernel_available()
    # kernel scales are bfloat16: each block's scale within 2^-8 relative
    torch.testing.assert_close(layer.format.dequantize(layer), w, rtol=2**-8, atol=1e-3)
    torch.testing.assert_close(layer(x), x @ w.t(), rtol=0.02, atol=0.05)


def test_unsupported_tensor_type_is_named(tmp_path):
    tensors = hf_tensors()

    def with_q5(name):
        return Q.Q5_0 if name.endswith("mlp.up_proj.weight") else default_types(name)

    path = write_tiny_gguf(tmp_path / "q5.gguf", tensors, types=with_q5)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight.*Q5_0"):
        open_model_source(str(path))


def test_untied_head_and_directory_with_one_gguf(tmp_path):
    tensors = hf_tensors(tied=False)
    write_tiny_gguf(tmp_path / "m.gguf", tensors)
    src = open_model_source(str(tmp_path), dtype=torch.float32)
    assert src.config["tie_word_embeddings"] is False
    assert "lm_head.weight" in dict(src.iter_weights())


def test_unknown_gguf_tensor_name_is_named():
    with pytest.raises(ValueError, match="blk.0.attn_qkv.weight"):
        hf_name("blk.0.attn_qkv.weight")


def test_bad_paths_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        open_model_source(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        open_model_source(str(tmp_path))
    (tmp_path / "a.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="a.gguf"):
        open_model_source(str(tmp_path / "a.gguf"))
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="several GGUF files"):
        open_model_source(str(tmp_path))
