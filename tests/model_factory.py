"""Tiny random models for tests, written with transformers itself so parity tests compare
against the reference implementation on exactly the same weights."""

from __future__ import annotations

from pathlib import Path

import torch

from batchgen.bench.tiny_llama import train_bpe_tokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "translate into french: good morning, how are you today?",
    "summarize the quarterly report in two sentences.",
    "stop here. END of the message. <end> done",
    "1234567890 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?-'\"()",
]


def make_tokenizer(out: Path, vocab_size: int = 320):
    """A small byte-level BPE tokenizer (every string encodes) saved for AutoTokenizer."""
    fast = train_bpe_tokenizer(
        CORPUS * 4,
        vocab_size=vocab_size,
        special_tokens=("<s>", "</s>"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token=None,
        pad_token=None,
        chat_template=(
            "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}"
        ),
    )
    fast.save_pretrained(out)
    return fast


def make_tiny_llama(out: Path, seed: int = 0, with_tokenizer: bool = True, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = 320
    if with_tokenizer:
        vocab = len(make_tokenizer(out))
    cfg = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        # wider than transformers' 0.02 so logits are peaked: greedy choices then have
        # margins far above float32 rounding, and batch-shape-dependent rounding (e.g.
        # after a preemption) cannot flip a near-tie
        initializer_range=0.2,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    model.save_pretrained(out)
    return out
