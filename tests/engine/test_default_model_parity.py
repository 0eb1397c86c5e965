"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against transformers
loading the same GGUF file: the first 16 greedy tokens of three chat prompts."""

import pytest
import torch

from engine import SamplingParams

CHATS = [
    [{"role": "user", "content": "Translate into French: good morning"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Summarize: the meeting moved to Friday at 10:30."},
    ],
]


@pytest.fixture(scope="module")
def reference(default_model_path, default_model_llm):
    """transformers' own GGUF loading and generate on the same file. The chat is tokenized
    by the transformers tokenizer the engine holds (Tokenizer.from_gguf is that tokenizer,
    loaded from the file by transformers: a second load would read the same metadata)."""
    from transformers import AutoModelForCausalLM

    gguf_path = default_model_path
    tok = default_model_llm.tokenizer.hf
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    ).eval()
    out = []
    for chat in CHATS:
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        gen = model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16
        )
        out.append((list(ids), gen[0, len(ids) :].tolist()))
    return out


def test_first_16_greedy_tokens_equal_transformers(reference, default_model_llm):
    llm = default_model_llm
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16)
    for (prompt_ids, want), chat in zip(reference, CHATS):
        rendered = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        assert llm.tokenizer.encode(rendered, add_special_tokens=False) == prompt_ids
        got = llm.generate([prompt_ids], params)[0].outputs[0].token_ids
        assert got == want
