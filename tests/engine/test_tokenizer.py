"""Tokenizer from the default model's GGUF metadata and from a Hugging Face directory."""

from __future__ import annotations

import json

import pytest

from engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def gguf_tokenizer(default_model_llm):
    """The tokenizer the engine read from the default model's GGUF metadata (the session's
    model, tests/conftest.py: building another parses the same metadata again)."""
    tok = default_model_llm.tokenizer
    assert isinstance(tok, Tokenizer)
    return tok


def test_gguf_tokenizer_round_trip_and_specials(gguf_tokenizer):
    tok = gguf_tokenizer
    text = "Translate into French: good morning, Émile!"
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == [2] and tok.bos_token_id == 1
    assert tok.decode([2], skip_special_tokens=False) == "<|im_end|>"
    assert tok.decode(ids + [2]) == text


def test_gguf_chat_template(gguf_tokenizer):
    tok = gguf_tokenizer
    assert tok.has_chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    no_gen = tok.apply_chat_template([{"role": "user", "content": "hi"}], False)
    assert not no_gen.endswith("assistant\n")


def test_directory_tokenizer_merges_generation_config_eos(gguf_tokenizer, tmp_path):
    gguf_tokenizer.hf.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_ids == [2, 0]
    assert tok.encode("hello world") == gguf_tokenizer.encode("hello world")


def test_no_chat_template_is_a_clear_error(gguf_tokenizer, tmp_path):
    gguf_tokenizer.hf.save_pretrained(tmp_path)
    for leftover in tmp_path.glob("chat_template.*"):
        leftover.unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_dir(tmp_path)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert Tokenizer.from_dir(tmp_path) is None
