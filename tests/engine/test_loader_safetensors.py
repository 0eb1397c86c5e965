"""Hugging Face directories: single file and sharded round trips, index checks, errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from engine.loader import open_model_source


def save_tiny_llama(directory, max_shard_size: str | None = None, tie: bool = False):
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(cfg)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_round_trip(tmp_path, shard):
    expected = save_tiny_llama(tmp_path, shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard is not None)
    src = open_model_source(str(tmp_path))
    assert src.config["hidden_size"] == 32 and src.format == "safetensors"
    names = []
    for name, tensor in src.iter_weights():
        names.append(name)
        assert torch.equal(tensor, expected[name]), name
    assert len(names) == len(set(names))
    assert set(names) == set(expected)
    assert src.tokenizer is None  # no tokenizer files saved


def test_tied_checkpoint_yields_only_stored_tensors(tmp_path):
    save_tiny_llama(tmp_path, tie=True)
    names = {n for n, _ in open_model_source(str(tmp_path)).iter_weights()}
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_explicit_dtype_converts_floats(tmp_path):
    save_tiny_llama(tmp_path)
    for _, tensor in open_model_source(str(tmp_path), dtype=torch.bfloat16).iter_weights():
        assert tensor.dtype == torch.bfloat16


def test_tensor_missing_from_its_shard_is_named(tmp_path):
    save_tiny_llama(tmp_path, "20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim, shard = next(iter(sorted(index["weight_map"].items())))
    tensors = load_file(tmp_path / shard)
    del tensors[victim]
    save_file(tensors, tmp_path / shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        list(open_model_source(str(tmp_path)).iter_weights())


def test_shard_file_missing_is_named(tmp_path):
    save_tiny_llama(tmp_path, "20KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        open_model_source(str(tmp_path))


def test_config_and_weights_errors_name_the_path(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        open_model_source(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        open_model_source(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(OSError, match="model.safetensors"):
        list(open_model_source(str(tmp_path)).iter_weights())


def test_unknown_quantization_method_is_named(tmp_path):
    save_tiny_llama(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "made_up"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="made_up"):
        open_model_source(str(tmp_path))


def test_weights_are_streamed_not_preloaded(tmp_path):
    save_tiny_llama(tmp_path, "20KB")
    stream = open_model_source(str(tmp_path)).iter_weights()
    first_name, first = next(stream)  # a generator: one tensor at a time
    assert isinstance(first, torch.Tensor) and first_name
