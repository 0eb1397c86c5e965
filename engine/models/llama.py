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
from engine.layers.decoder_layer import PreNormDecoderLayer
from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, rope_parameters
from engine.models.base import CacheSpec, CausalLM
from engine.models.weights import load_strict
from engine.ops.attention_context import AttentionContext
from engine.quant.base import QuantConfig
from kernels.cpu import batch_invariant


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


def _same_format(quant: QuantConfig | None, prefixes: list[str], d_in: int, outs: list[int]):
    """Fused projections store their parts in one format; a checkpoint that quantized the
    parts differently cannot be fused (say so rather than misread bytes)."""
    if quant is None:
        return
    names = {quant.format_for(p, d_in, o).name for p, o in zip(prefixes, outs)}
    if len(names) > 1:
        raise ValueError(
            f"{', '.join(prefixes)} are stored in different formats ({sorted(names)}); "
            "the llama family needs them in one format"
        )


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
        # q, k and v as one matmul: at batch 1 on a CPU each call is latency-bound, so
        # three small ones cost nearly three times one fused one (loaded row-wise from the
        # checkpoint's separate q_proj / k_proj / v_proj; see LlamaForCausalLM.fused)
        self.split = [self.num_heads * Dh, self.num_kv_heads * Dh, self.num_kv_heads * Dh]
        _same_format(quant, [f"{prefix}.{p}_proj" for p in "qkv"], D, self.split)
        self.qkv_proj = Linear(D, sum(self.split), bias, quant, f"{prefix}.q_proj")
        self.o_proj = Linear(self.num_heads * Dh, D, False, quant, f"{prefix}.o_proj")
        self.rotary = RotaryEmbedding(Dh, cfg.rope, cfg.max_position_embeddings)
        self.scale = Dh**-0.5
        self.kv_cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext):
        T = x.shape[0]
        H, Hk = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, H + 2 * Hk, self.head_dim)
        # q and k heads are adjacent in the fused output: rotate them in one pass
        (qk,) = self.rotary(positions, qkv[:, : H + Hk], ctx=ctx)
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hk :]
        write_kv(self.kv_cache, ctx, k, v)
        out = paged_attention(q, self.kv_cache, ctx, self.scale)  # [T, H, Dh]
        return self.o_proj(out.reshape(T, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, quant: QuantConfig | None, prefix: str):
        super().__init__()
        D, I = cfg.hidden_size, cfg.intermediate_size
        _same_format(quant, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], D, [I, I])
        self.gate_up_proj = Linear(D, 2 * I, cfg.mlp_bias, quant, f"{prefix}.gate_proj")
        self.down_proj = Linear(I, D, cfg.mlp_bias, quant, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)  # [T, D]


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, cfg: LlamaConfig, quant: QuantConfig | None, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, quant, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, quant, f"{prefix}.mlp")


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
            return batch_invariant.linear(hidden, self.model.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # [N, V]

    def cache_specs(self) -> list[CacheSpec]:
        c = self.config
        return [CacheSpec((2, c.num_key_value_heads, c.head_dim))] * c.num_hidden_layers

    def bind_kv_cache(self, caches: list[torch.Tensor]) -> None:
        for layer, cache in zip(self.model.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache

    # checkpoint projection -> (fused module, which part): rows are stacked in this order
    FUSED = {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0),
        "self_attn.k_proj": ("self_attn.qkv_proj", 1),
        "self_attn.v_proj": ("self_attn.qkv_proj", 2),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0),
        "mlp.up_proj": ("mlp.gate_up_proj", 1),
    }

    def fused_rows(self, part: str, index: int) -> int:
        """First row of checkpoint part `index` inside a fused projection (parts are in
        checkpoint order; the format stores whole rows, so rows of raw GGUF blocks stack
        the same way as float rows)."""
        c = self.config
        if part == "self_attn.qkv_proj":
            return [0, c.num_attention_heads, c.num_attention_heads + c.num_key_value_heads][
                index
            ] * c.head_dim
        return index * c.intermediate_size

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def rename(name: str):
            if name.endswith("rotary_emb.inv_freq"):
                return None  # derived from the config, not learned
            if self.lm_head is None and name == "lm_head.weight":
                return None  # tied: the embedding is the head
            head, _, rest = name.partition(".layers.")
            layer, _, tail = rest.partition(".")
            for part, (fused, index) in self.FUSED.items():
                if tail.startswith(part + "."):
                    leaf = tail[len(part) + 1 :]
                    return f"{head}.layers.{layer}.{fused}.{leaf}", self.fused_rows(fused, index)
            return name

        def sources(param: str) -> list[str]:
            head, _, rest = param.partition(".layers.")
            layer, _, tail = rest.partition(".")
            return [
                f"{head}.layers.{layer}.{part}.{tail.rpartition('.')[2]}"
                for part, (fused, _) in self.FUSED.items()
                if tail.startswith(fused + ".")
            ]

        load_strict(self, weights, rename, fused_sources=sources)
