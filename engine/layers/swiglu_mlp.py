"""The gated feed-forward block DeepSeek uses for dense layers and shared experts:
down(silu(gate(x)) * up(x)), each projection a `Linear` in the checkpoint's format. With
`swiglu_limit` (V4's shared expert) gate and up are clamped first, as in engine/ops/moe.py's
swiglu (transformers' DeepseekV4MLP clamps the shared expert; DeepSeek's own code does not)."""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.ops.moe import swiglu
from engine.quant.base import QuantConfig


class SwiGluMlp(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        quant: QuantConfig | None,
        prefix: str,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        D, I = hidden_size, intermediate_size
        self.swiglu_limit = swiglu_limit
        self.gate_proj = Linear(D, I, False, quant, f"{prefix}.gate_proj")
        self.up_proj = Linear(D, I, False, quant, f"{prefix}.up_proj")
        self.down_proj = Linear(I, D, False, quant, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = swiglu(self.gate_proj(x), self.up_proj(x), self.swiglu_limit)  # [T, I]
        return self.down_proj(act)  # [T, D]
