"""Parity with transformers' DeepseekV3ForCausalLM (eager, float32) on tiny random configs,
through batched prefill, chunked prefill mixed with decode, and batched decode."""

import pytest
import torch

from tests.engine.deepseek_helpers import (
    PagedRunner,
    engine_model_from_hf,
    hf_logits,
    hf_model,
    relative_error,
)

CONFIGS = {
    "qlora_groups_dense1": dict(),
    "no_qlora_ngroup1_dense0_noshared": dict(
        q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0, n_shared_experts=0
    ),
    "yarn_dense2_shared2_4groups": dict(
        n_group=4,
        topk_group=2,
        first_k_dense_replace=2,
        n_shared_experts=2,
        num_hidden_layers=4,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            original_max_position_embeddings=32,
            mscale=1.0,
            mscale_all_dim=0.8,
            beta_fast=32,
            beta_slow=1,
        ),
    ),
    "top1_unnormalized_tied": dict(
        num_experts_per_tok=1, norm_topk_prob=False, routed_scaling_factor=1.0
    ),
}
PROMPTS = [
    [3, 17, 42, 5, 9, 11, 60, 2, 8],
    [7],
    [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 4],
]
NEW_TOKENS = 5


def run_schedule(model, prompts):
    """Prefill seq 0 whole and seq 2 in two chunks (the second chunk sharing a step with
    decodes), seq 1 whole; then batched greedy decode. Returns (tokens, logits rows)."""
    runner = PagedRunner(model, block_size=4, num_blocks=64)
    tokens = [list(p) for p in prompts]
    rows = {i: [] for i in range(len(prompts))}
    split = len(prompts[2]) // 2

    def take(seq, logits):
        rows[seq].append(logits)

    out = runner.step([(0, prompts[0]), (2, prompts[2][:split])])
    take(0, out[0]), take(2, out[1])
    tokens[0].append(int(out[0][-1].argmax()))
    out = runner.step([(2, prompts[2][split:]), (0, tokens[0][-1:]), (1, prompts[1])])
    take(2, out[0]), take(0, out[1]), take(1, out[2])
    tokens[2].append(int(out[0][-1].argmax()))
    tokens[0].append(int(out[1][-1].argmax()))
    tokens[1].append(int(out[2][-1].argmax()))
    while min(len(t) - len(p) for t, p in zip(tokens, prompts)) < NEW_TOKENS:
        out = runner.step([(i, t[-1:]) for i, t in enumerate(tokens)])
        for i, logits in enumerate(out):
            take(i, logits)
            tokens[i].append(int(logits[-1].argmax()))
    return tokens, {i: torch.cat(r) for i, r in rows.items()}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_greedy_tokens_match_transformers(name):
    overrides = dict(CONFIGS[name])
    if name == "top1_unnormalized_tied":
        overrides["tie_word_embeddings"] = True
    hf = hf_model(seed=len(name), **overrides)
    model = engine_model_from_hf(hf)
    tokens, rows = run_schedule(model, PROMPTS)
    worst = 0.0
    for i, toks in enumerate(tokens):
        ref = hf_logits(hf, toks)[: rows[i].shape[0]]
        worst = max(worst, relative_error(rows[i], ref))
        # greedy: every generated token is the reference's argmax at its position
        start = len(PROMPTS[i]) - 1
        assert ref[start:].argmax(-1).tolist() == toks[start + 1 :]
    assert worst < 1e-4, f"{name}: max relative logit error {worst:.2e}"


def test_greedy_tokens_equal_transformers_generate():
    hf = hf_model(seed=5)
    model = engine_model_from_hf(hf)
    tokens, _ = run_schedule(model, PROMPTS)
    for prompt, toks in zip(PROMPTS, tokens):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert out[0].tolist()[: len(toks)] == toks[: len(prompt) + NEW_TOKENS]


@pytest.mark.parametrize("mode", ["absorbed", "expanded"])
def test_absorbed_and_expanded_mla_give_the_same_logits(mode):
    hf = hf_model(seed=11, q_lora_rank=None)
    model = engine_model_from_hf(hf)
    _, auto_rows = run_schedule(model, PROMPTS)
    model.set_mla_mode(mode)
    _, rows = run_schedule(model, PROMPTS)
    for i in auto_rows:
        assert relative_error(rows[i], auto_rows[i]) < 1e-5


def test_cache_holds_latent_and_rope_key_only():
    hf = hf_model(seed=2)
    model = engine_model_from_hf(hf)
    c = model.config
    specs = model.cache_specs()
    assert len(specs) == c.num_hidden_layers  # transformers' state dict has no MTP layer
    per_token = (c.kv_lora_rank + c.qk_rope_head_dim) * torch.float32.itemsize
    assert all(s.bytes_per_token(torch.float32) == per_token for s in specs)
    runner = PagedRunner(model, block_size=4, num_blocks=8)
    for cache in runner.caches:
        assert cache.numel() * cache.element_size() == 8 * 4 * per_token
    # and the cache really is what the model reads: a prefill writes exactly 3 token rows
    runner.step([(0, [5, 6, 7])])
    written = sum(int((cache.abs().sum(-1) != 0).sum()) for cache in runner.caches)
    assert written == 3 * c.num_hidden_layers


def test_deepseek_v2_config_matches_transformers_v2():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from tests.engine.deepseek_helpers import TINY, randomize_

    drop = ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")
    kwargs = {k: v for k, v in TINY.items() if k not in drop}
    cfg = DeepseekV2Config(
        **kwargs, topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=False
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = DeepseekV2ForCausalLM(cfg).eval()
    randomize_(hf, 3)
    model = engine_model_from_hf(hf)
    assert model.config.scoring_func == "softmax"
    tokens, rows = run_schedule(model, PROMPTS)
    for i, toks in enumerate(tokens):
        ref = hf_logits(hf, toks)[: rows[i].shape[0]]
        assert relative_error(rows[i], ref) < 1e-4
