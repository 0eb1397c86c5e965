"""Random-weight llama checkpoints in the Hugging Face layout (`batchgen models make-random
--arch llama`), bf16: the dense family's twin of the DeepSeek makers, for tests of paths
every family shares (the `random:` model source among them).

Tensors: `model.embed_tokens.weight`, per layer `input_layernorm`,
`post_attention_layernorm`, `self_attn.{q,k,v,o}_proj` and `mlp.{gate,up,down}_proj`,
then `model.norm.weight` and `lm_head.weight`. Each is drawn from its own generator seeded
by (seed, name), with the DeepSeek makers' scales: linears ~ N(0, 1/fan_in), norms ~
1 + N(0, 0.1^2), the embedding ~ N(0, 1).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from engine.checkpoint_files import BOS_ID, EOS_ID, draw

# tiny: grouped-query attention (4 heads over 2 KV heads), an untied head, dims small
# enough for CPU tests; the vocabulary is the byte tokenizer's 258 ids.
PRESETS: dict[str, dict] = {
    "tiny": {
        "vocab_size": 258,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    },
}
NORM_STD = 0.1


def build_config(preset: str, layers: int | None) -> dict:
    """config.json of `preset` with `layers` layers (default: the preset's)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown llama preset {preset!r}; choose one of {sorted(PRESETS)}")
    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    shape = dict(PRESETS[preset])
    if layers is not None:
        shape["num_hidden_layers"] = layers
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": "bfloat16",
        "batchgen_random_preset": preset,
    }


def llama_tensors(
    config: dict, seed: int, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint `config` describes, bf16, drawn on `device` in
    checkpoint order."""
    D, V = config["hidden_size"], config["vocab_size"]
    H, KV = config["num_attention_heads"], config["num_key_value_heads"]
    Dh, inter = D // H, config["intermediate_size"]

    def linear(name: str, out_f: int, in_f: int):
        value = draw(name, (out_f, in_f), 1 / math.sqrt(in_f), 0.0, seed, device)
        return name, value.bfloat16()

    def norm(name: str):
        return name, draw(name, (D,), NORM_STD, 1.0, seed, device).bfloat16()

    yield (
        "model.embed_tokens.weight",
        draw("model.embed_tokens.weight", (V, D), 1.0, 0.0, seed, device).bfloat16(),
    )
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield norm(f"{p}.input_layernorm.weight")
        yield norm(f"{p}.post_attention_layernorm.weight")
        yield linear(f"{p}.self_attn.q_proj.weight", H * Dh, D)
        yield linear(f"{p}.self_attn.k_proj.weight", KV * Dh, D)
        yield linear(f"{p}.self_attn.v_proj.weight", KV * Dh, D)
        yield linear(f"{p}.self_attn.o_proj.weight", D, H * Dh)
        yield linear(f"{p}.mlp.gate_proj.weight", inter, D)
        yield linear(f"{p}.mlp.up_proj.weight", inter, D)
        yield linear(f"{p}.mlp.down_proj.weight", D, inter)
    yield norm("model.norm.weight")
    if not config["tie_word_embeddings"]:
        yield linear("lm_head.weight", V, D)
