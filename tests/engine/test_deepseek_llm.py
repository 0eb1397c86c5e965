"""End to end through engine.LLM on random DeepSeek-V3 checkpoints from the maker:
greedy tokens equal transformers' generate; quantized checkpoints run; MTP drafts leave
greedy outputs unchanged; routing statistics come back per layer."""

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoint_maker import make_random_checkpoint

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 9], [256, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]
NEW = 8


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm")
    return {
        "bf16": make_random_checkpoint(root / "bf16", preset="tiny", seed=1),
        "fp8-mxfp4": make_random_checkpoint(
            root / "q", preset="tiny", seed=1, dense_dtype="fp8", expert_dtype="mxfp4"
        ),
    }


def greedy(llm):
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def test_llm_greedy_equals_transformers_generate(checkpoints):
    from transformers import DeepseekV3ForCausalLM as HF
    from transformers.utils import logging

    logging.set_verbosity_error()  # it reports the MTP layer it does not model as unexpected
    path = checkpoints["bf16"]
    got = greedy(LLM(str(path), device="cpu", dtype="float32"))
    hf = HF.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    for prompt, tokens in zip(PROMPTS, got):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert list(tokens) == out[0, len(prompt) :].tolist()


def test_llm_mtp_drafts_keep_greedy_outputs(checkpoints):
    path = str(checkpoints["bf16"])
    want = greedy(LLM(path, device="cpu", dtype="float32"))
    llm = LLM(path, device="cpu", dtype="float32", speculative_tokens=2)
    assert greedy(llm) == want
    stats = llm.speculative_stats()
    assert stats is not None and len(stats["histogram"]) == 3
    print("accepted-length histogram", stats["histogram"])


def test_quantized_checkpoint_runs_and_reports_routing(checkpoints):
    llm = LLM(str(checkpoints["fp8-mxfp4"]), device="cpu", dtype="float32", record_routing=True)
    out = greedy(llm)
    assert all(len(t) == NEW for t in out)
    stats = llm.routing_stats()
    moe_layers = [1, 2]  # tiny: layer 0 is dense
    layers = stats["all"]["layers"]
    assert sorted(layers) == moe_layers
    # one MXFP4 expert: 3 projections of 64x32 values at 0.5 byte + one E8M0 per 32 values
    per_expert = 3 * (64 * 32 // 2 + 64 * 32 // 32)
    for layer in moe_layers:
        mean = layers[layer]["mean_distinct_experts"]
        assert 1 <= mean <= 8
        assert layers[layer]["mean_expert_bytes"] == pytest.approx(mean * per_expert)
    decode = stats["decode"]["layers"]
    assert all(decode[layer]["mean_distinct_experts"] <= 3 * 2 for layer in moe_layers)
