"""Our llama family against transformers' own implementation on the same random weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from tests.model_factory import make_tiny_llama

PROMPTS = [[5, 9, 13, 2, 7], [40, 41], list(range(10, 47)), [100] * 3 + [7, 8, 9, 200]]


def hf_greedy(model_dir, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: never stop, never ban
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"num_key_value_heads": 4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
    ids=["untied", "tied", "mha-linear-rope", "llama3-rope"],
)
def test_greedy_tokens_match_transformers(tmp_path, overrides):
    model_dir = make_tiny_llama(tmp_path, with_tokenizer=False, **overrides)
    # small blocks and a small token budget: sequences span many blocks and prompts are
    # prefilled in several chunks mixed with other sequences' decode tokens
    llm = LLM(str(model_dir), dtype="float32", block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 10)
        assert out.outputs[0].finish_reason == "length"
        assert out.num_prompt_tokens == len(prompt)


def test_logits_match_transformers(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, max_num_batched_tokens=8)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prompt = list(range(3, 30))
    runner = llm.engine.runner
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence

    seq = Sequence("x", 0, prompt, SamplingParams(temperature=0), None)
    llm.engine.scheduler.blocks.grow(seq, len(prompt))
    hidden = []
    # prefill in chunks of 8 through the paged cache, then compare every position
    while seq.num_computed < len(prompt):
        n = min(8, len(prompt) - seq.num_computed)
        ids, pos, ctx = runner.prepare(ScheduledBatch([seq], [n]))
        with torch.inference_mode():
            hidden.append(runner.model(ids, pos, ctx))
        seq.num_computed += n
    ours = runner.model.compute_logits(torch.cat(hidden))
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-4, f"relative logit error {rel:.2e}"
    llm.engine.scheduler.blocks.release(seq)


def test_missing_projection_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from engine.models.weights import CheckpointMismatch

    model_dir = make_tiny_llama(tmp_path, with_tokenizer=False)
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch) as err:
        LLM(str(model_dir), dtype="float32")
    assert "model.layers.1.self_attn.k_proj.weight" in str(err.value)
    assert "model.layers.0.mlp.extra.weight" in str(err.value)
