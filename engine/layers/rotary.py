"""Rotary position embeddings with the scalings seen in config.json files.

`rope_parameters` accepts both spellings found in the wild: transformers 4's
`rope_theta` + `rope_scaling`, and transformers 5's `rope_parameters`. The frequency
formulas follow the published definitions (default, linear, llama3, yarn), computed in
float32 as the reference implementations do so greedy tokens match them.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(config: dict) -> dict:
    """One flat dict: rope_type, rope_theta, and the type's own keys."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings", config.get("max_position_embeddings", 2048)
        )
    return params


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def compute_inv_freq(
    params: dict, dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention_factor applied to cos and sin)."""
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(params, dim, base, max_position_embeddings)
    raise ValueError(f"unsupported rope type {kind!r} (supported: default, linear, llama3, yarn)")


def _yarn_inv_freq(params: dict, dim: int, base: float, max_pos: int) -> tuple[torch.Tensor, float]:
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_pos / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies rope to q [T, H, dim] and k [T, Hk, dim] at absolute `positions` [T].

    interleaved=False rotates the two halves of the head (Llama, "neox" layout);
    interleaved=True rotates adjacent pairs (DeepSeek's checkpoints). Both return the
    rotated values in the input's own layout.
    """

    def __init__(
        self, dim: int, params: dict, max_position_embeddings: int, interleaved: bool = False
    ):
        super().__init__()
        self.dim = dim
        self.interleaved = interleaved
        # computed on the CPU whatever device the model is built on (the meta device too,
        # where expert placement measures a model without memory), then moved there
        with torch.device("cpu"):
            inv_freq, self.attention_factor = compute_inv_freq(
                params, dim, max_position_embeddings
            )
        # Layers with the same rope share one cos/sin per step (see forward's ctx).
        self.share_key = ("rope", dim, self.attention_factor, *inv_freq[[0, -1]].tolist())
        self.register_buffer("inv_freq", inv_freq.to(torch.empty(0).device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, dim/2]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def forward(
        self, positions: torch.Tensor, *xs: torch.Tensor, ctx=None
    ) -> tuple[torch.Tensor, ...]:
        """With the step's AttentionContext, cos/sin are computed once per step for all
        layers that share this rope."""
        if ctx is None:
            cos, sin = self.cos_sin(positions)
        else:
            cos, sin = ctx.shared(self.share_key, lambda: self.cos_sin(positions))
        return tuple(self.rotate(x, cos, sin) for x in xs)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, dim/2]
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        else:
            x1, x2 = xf[..., : self.dim // 2], xf[..., self.dim // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(dtype)
