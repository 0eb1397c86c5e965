"""The gated feed-forward block DeepSeek uses for dense layers and shared experts:
down(silu(gate(x)) * up(x)), each projection a `Linear` in the checkpoint's format."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import Linear
from engine.quant.base import QuantConfig


class SwiGluMlp(nn.Module):
    def __init__(
        self, hidden_size: int, intermediate_size: int, quant: QuantConfig | None, prefix: str
    ) -> None:
        super().__init__()
        D, I = hidden_size, intermediate_size
        self.gate_proj = Linear(D, I, False, quant, f"{prefix}.gate_proj")
        self.up_proj = Linear(D, I, False, quant, f"{prefix}.up_proj")
        self.down_proj = Linear(I, D, False, quant, f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # [T, D]
