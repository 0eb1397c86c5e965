"""A tiny random llama in Hugging Face layout with a byte-level BPE tokenizer trained on the
spot (nothing downloaded): the model the pipeline benchmarks and tests run on, whose own
footprint and speed are small enough that what they measure is the pipeline."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_bpe_tokenizer(
    corpus: Sequence[str],
    vocab_size: int = 512,
    special_tokens: Sequence[str] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
    bos_token: str = "<|im_start|>",
    eos_token: str = "<|im_end|>",
    unk_token: str | None = "<|endoftext|>",
    pad_token: str | None = "<|endoftext|>",
    chat_template: str = CHATML_TEMPLATE,
):
    """A byte-level BPE tokenizer (any unicode text encodes) trained on `corpus`, as a
    transformers PreTrainedTokenizerFast with `chat_template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    optional = {"unk_token": unk_token, "pad_token": pad_token}
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token=eos_token,
        **{k: v for k, v in optional.items() if v is not None},
    )
    fast.chat_template = chat_template
    return fast


def write_tiny_llama(out: Path, corpus: Sequence[str], seed: int = 0) -> Path:
    """A random 2-layer llama (hidden 32) with a ChatML tokenizer trained on `corpus`,
    saved to `out` (~1 MB)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    tokenizer = train_bpe_tokenizer(corpus)
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out)
    return out
