"""Llama-family dense decoder (Llama, SmolLM, Qwen2, Mistral): RMSNorm, RoPE, GQA, SwiGLU.

Legend: T = tokens in the step, D = hidden, H = query heads, Hk = kv heads, Dh = head dim,
I = intermediate, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import paged_attention, write_kv
from engine.layers.attention_context import AttentionContext
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.models.base import CacheSpec, CausalLM
from engine.models.weights import load_strict
from engine.quant.base import QuantConfig


@dataclass
class LlamaConfig:
    """Field names equal config.json keys."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    rope: dict | None = None  # normalized from rope_theta / rope_scaling / rope_parameters

    @classmethod
    def from_dict(cls, d: dict) -> LlamaConfig:
        known = {f.name for f in fields(cls)} - {"rope"}
        cfg = cls(**{k: v for k, v in d.items() if k in known and v is not None})
        cfg.num_key_value_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        cfg.head_dim = cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
        if cfg.model_type == "qwen2" and "attention_bias" not in d:
            cfg.attention_bias = True  # Qwen2 has q/k/v biases without saying so
        cfg.rope = rope_parameters(d)
        return cfg


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, quant: QuantConfig | None, prefix: str):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        D, Dh = cfg.hidden_size, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = Linear(D, self.num_heads * Dh, bias, quant, f"{prefix}.q_proj")
        self.k_proj = Linear(D, self.num_kv_heads * Dh, bias, quant, f"{prefix}.k_proj")
        self.v_proj = Linear(D, self.num_kv_heads * Dh, bias, quant, f"{prefix}.v_proj")
        self.o_proj = Linear(self.num_heads * Dh, D, False, quant, f"{prefix}.o_proj")
        self.rotary = RotaryEmbedding(Dh, cfg.rope, cfg.max_position_embeddings)
        self.scale = Dh**-0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext):
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k, ctx=ctx)
        write_kv(self.kv_cache, ctx, k, v)
        out = paged_attention(q, self.kv_cache, ctx, self.scale)  # [T, H, Dh]
        return self.o_proj(out.reshape(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, quant: QuantConfig | None, prefix: str):
        super().__init__()
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = Linear(D, I, cfg.mlp_bias, quant, f"{prefix}.gate_proj")
        self.up_proj = Linear(D, I, cfg.mlp_bias, quant, f"{prefix}.up_proj")
        self.down_proj = Linear(I, D, cfg.mlp_bias, quant, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, I] -> [T, D]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, quant: QuantConfig | None, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, quant, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, quant, f"{prefix}.mlp")

    def forward(self, x, residual, positions, ctx):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, quant: QuantConfig | None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, quant, f"model.layers.{i}") for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: dict, quant_config: QuantConfig | None = None):
        super().__init__()
        self.config = cfg = LlamaConfig.from_dict(config)
        self.model = LlamaModel(cfg, quant_config)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, False, quant_config, "lm_head")

    def forward(self, input_ids, positions, ctx):
        x = self.model.embed_tokens(input_ids)  # [T, D]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, positions, ctx)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return F.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # [N, V]

    def cache_specs(self) -> list[CacheSpec]:
        c = self.config
        return [CacheSpec((2, c.num_key_value_heads, c.head_dim))] * c.num_hidden_layers

    def bind_kv_cache(self, caches: list[torch.Tensor]) -> None:
        for layer, cache in zip(self.model.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str) -> str | None:
            if name.endswith("rotary_emb.inv_freq"):
                return None  # derived from the config, not learned
            if self.lm_head is None and name == "lm_head.weight":
                return None  # tied: the embedding is the head
            return name

        load_strict(self, weights, rename)
