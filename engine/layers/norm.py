"""RMSNorm: its weight, and the arithmetic of the device it runs on (engine/ops/norm.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.ops.device_layer import DeviceLayer, DeviceSetup, build
from engine.ops.norm import TORCH_NORM, NormOps


class RMSNorm(nn.Module, DeviceLayer):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.ops: NormOps = TORCH_NORM

    def prepare(self, setup: DeviceSetup) -> None:
        self.ops = build("rmsnorm", self, setup)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, returns (norm(x + residual), x + residual): the fused form the
        decoder layers use, so the sum is formed once."""
        return self.ops.forward(self, x, residual)
