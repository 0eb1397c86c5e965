"""DeepSeek-V4's attention for a sliding-window layer (compress ratio 0): its parameters
under the hub's names, its arithmetic from engine/ops/v4_attention.py (legend there and in
docs/shapes.md: T tokens, L keys, H heads, D hidden, P rope dims; `head_dim` spelled out).

The hub names, under the layer's `layers.{i}.attn.` prefix: `wq_a`, `q_norm`, `wq_b`, `wkv`,
`kv_norm`, `wo_a`, `wo_b`, `attn_sink`. transformers calls them `self_attn.q_a_proj`,
`q_a_norm`, `q_b_proj`, `kv_proj`, `kv_norm`, `o_a_proj`, `o_b_proj`, `sinks`.

The step is split where a paged window ring goes between: `query` and `key_value` project
the step's tokens (`key_value` is what the ring stores: one roped [head_dim] entry a token),
`attend` reads any set of keys with their positions, `output` de-rotates and projects.
`forward` is a whole prompt attending over its own keys.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import compute_inv_freq, rope_parameters
from engine.ops.v4_attention import (
    apply_rope,
    grouped_low_rank,
    rope_cos_sin,
    sink_attention,
    unit_rms,
    window_mask,
)
from engine.quant.base import QuantConfig


def v4_rope_parameters(config: dict, compressed: bool) -> dict:
    """The rope of one V4 layer kind as one flat dict for `compute_inv_freq`.

    Sliding-only layers: plain rope at `rope_theta` (1e4). Compressed layers (CSA, HCA):
    `compress_rope_theta` (1.6e5) with the config's YaRN scaling but attention factor 1
    (DeepSeek's reference does not scale cos/sin by YaRN's mscale). Reads the hub's keys
    (`rope_theta`, `compress_rope_theta`, `rope_scaling`) or transformers' nested
    `rope_parameters` {"main": ..., "compress": ...}; both give the same frequencies.
    """
    nested = config.get("rope_parameters") or {}
    if isinstance(nested.get("main"), dict):
        params = dict(nested["compress" if compressed else "main"])
        params.setdefault("rope_type", params.pop("type", "default"))
    elif not compressed:
        params = {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    else:
        max_pos = config.get("max_position_embeddings", 2048)
        params = rope_parameters(
            {"rope_scaling": config.get("rope_scaling"), "max_position_embeddings": max_pos}
        )
        # the compressed layers' own theta, whatever a rope_scaling dict carries
        params["rope_theta"] = config.get("compress_rope_theta", 160000.0)
    if params["rope_type"] == "yarn":
        params["attention_factor"] = 1.0
        params.setdefault(
            "original_max_position_embeddings", config.get("max_position_embeddings", 2048)
        )
    return params


class V4SlidingAttention(nn.Module):
    """MQA with one `head_dim`-wide head shared as key and value, over a window of
    `sliding_window` positions (the query's own included), with per-head sinks."""

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        head_dim: int,
        qk_rope_head_dim: int,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        sliding_window: int,
        rms_norm_eps: float,
        rope: dict,
        max_position_embeddings: int,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        H, head_dim = num_attention_heads, head_dim
        if (H * head_dim) % o_groups:
            raise ValueError(f"heads * head_dim = {H * head_dim} is not a multiple of o_groups")
        if qk_rope_head_dim % 2 or qk_rope_head_dim > head_dim:
            raise ValueError(f"qk_rope_head_dim {qk_rope_head_dim}: even and <= head_dim")
        self.num_heads, self.head_dim = H, head_dim
        self.o_groups = o_groups
        self.sliding_window = sliding_window
        self.eps = rms_norm_eps
        self.scale = head_dim**-0.5
        self.prefix = prefix

        def linear(name: str, in_features: int, out_features: int) -> Linear:
            prefixed = f"{prefix}{name}"
            return Linear(in_features, out_features, quant_config=quant_config, prefix=prefixed)

        self.wq_a = linear("wq_a", hidden_size, q_lora_rank)
        self.q_norm = RMSNorm(q_lora_rank, rms_norm_eps)
        self.wq_b = linear("wq_b", q_lora_rank, H * head_dim)
        self.wkv = linear("wkv", hidden_size, head_dim)
        self.kv_norm = RMSNorm(head_dim, rms_norm_eps)
        # Read whole by the grouped product (not through the linear ops): a quantized
        # format is dequantized per call, which DeepSeek's own conversion does once.
        self.wo_a = linear("wo_a", H * head_dim // o_groups, o_groups * o_lora_rank)
        self.wo_b = linear("wo_b", o_groups * o_lora_rank, hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(H, dtype=torch.float32), requires_grad=False)
        inv_freq, attention_factor = compute_inv_freq(
            rope, qk_rope_head_dim, max_position_embeddings
        )
        if attention_factor != 1.0:
            raise ValueError(f"V4's rope has no attention factor (got {attention_factor})")
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [P/2]

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin) [T, P/2] float32."""
        return rope_cos_sin(positions, self.inv_freq)

    def query(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (q [T, H, head_dim] roped, qr [T, q_lora_rank]: the normalised low-rank q,
        which a CSA layer's indexer reads too)."""
        qr = self.q_norm(self.wq_a(x))
        q = self.wq_b(qr).view(x.shape[0], self.num_heads, self.head_dim)
        return apply_rope(unit_rms(q, self.eps), cos, sin), qr

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> kv [T, head_dim]: the roped entry a window ring stores per token."""
        return apply_rope(self.kv_norm(self.wkv(x)), cos, sin)

    def attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, H, head_dim] at q_pos [T], keys [L, head_dim] at k_pos [L] -> o [T, H, head_dim]. Keys outside
        a query's window (or after it) are masked, so any superset of the window gives the
        same result."""
        visible = window_mask(q_pos, k_pos, self.sliding_window)
        return sink_attention(q, keys, visible, self.attn_sink, self.scale)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """o [T, H, head_dim] (rotated as its keys were) -> [T, D]: de-rotate at the query's
        position, the grouped wo_a, then wo_b."""
        o = apply_rope(o, cos, -sin)
        wo_a = self.wo_a.format.dequantize(self.wo_a).to(o.dtype)
        return self.wo_b(grouped_low_rank(o, wo_a))

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One sequence's whole prompt: x [T, D] at positions [T] -> [T, D], each token
        attending over the prompt's own keys in its window. The mask reads positions only,
        so a flat batch of several sequences must call `attend` per sequence."""
        cos, sin = self.cos_sin(positions)
        q, _ = self.query(x, cos, sin)
        kv = self.key_value(x, cos, sin)
        return self.output(self.attend(q, kv, positions, positions), cos, sin)

    def checkpoint_tensors(self) -> dict[str, nn.Parameter]:
        """Hub checkpoint name -> parameter ("layers.0.attn.wq_a.weight", ...)."""
        return {f"{self.prefix}{n}": p for n, p in self.named_parameters()}

    def extra_repr(self) -> str:
        return (
            f"{self.prefix or 'attn'} heads={self.num_heads}, head_dim={self.head_dim}, "
            f"window={self.sliding_window}, groups={self.o_groups}"
        )
