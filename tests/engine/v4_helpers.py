"""Tiny DeepSeek-V4 models for tests: transformers' own DeepseekV4ForCausalLM (eager,
float32) with every tensor randomised, including the ones transformers initialises to
zeros or constants (tid2eid, sinks, positional biases, mHC base and scale, the router
bias: MODELS.md section 3), and the engine's model on the same weights."""

from __future__ import annotations

import math

import torch

# every feature on: a sliding, CSA, HCA and CSA layer, one hash layer, clamps that bind
TINY_V4 = dict(
    vocab_size=128,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    partial_rotary_factor=0.25,
    num_experts_per_tok=2,
    n_routed_experts=8,
    n_shared_experts=1,
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    index_n_heads=2,
    index_head_dim=16,
    index_topk=64,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    swiglu_limit=1.5,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)


def hf_v4_config(**overrides):
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(**{**TINY_V4, **overrides})
    cfg._attn_implementation = "eager"
    return cfg


@torch.no_grad()
def randomize_v4_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    experts = model.config.n_routed_experts
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, p in tensors:
        if not p.is_floating_point():
            if name.endswith("tid2eid"):  # top_k distinct experts per token
                rows = [torch.randperm(experts, generator=gen)[: p.shape[1]] for _ in p]
                p.copy_(torch.stack(rows))
            continue
        if name.endswith(("inv_freq", "original_inv_freq")):
            continue
        randn = torch.randn(p.shape, generator=gen)
        if name.endswith("sinks"):
            p.copy_(randn)
        elif name.endswith(("position_bias", "hc_base")):
            p.copy_(randn * 0.5)
        elif name.endswith("hc_scale"):
            p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        elif name.endswith("hc_fn"):
            p.copy_(randn / math.sqrt(p.shape[-1]))
        elif name.endswith("e_score_correction_bias"):
            p.copy_(randn * 0.1)
        elif "norm" in name:
            p.copy_(1 + randn * 0.1)
        elif "embed_tokens" in name:
            p.copy_(randn)
        else:
            p.copy_(randn / math.sqrt(max(p.shape[-1], 1)))


def hf_v4_model(seed: int = 0, **overrides):
    from transformers import DeepseekV4ForCausalLM as HF

    torch.manual_seed(seed)
    model = HF(hf_v4_config(**overrides)).eval()
    randomize_v4_(model, seed + 1)
    return model


def engine_v4_from_hf(hf):
    """The engine's model loaded from transformers' state dict ("hf" layout)."""
    from engine.models.deepseek_v4 import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(hf.config.to_dict()).eval()
    model.load_weights((n, t.detach()) for n, t in hf.state_dict().items())
    return model
