"""RMSNorm, computed in float32 as the reference implementations do."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`, returns (norm(x + residual), x + residual): the fused form the
        decoder layers use, so the sum is formed once."""
        if x.is_cuda:  # GPU backend: fused Triton kernel (engine/backends/cuda.py)
            from engine.backends.cuda import rmsnorm

            return rmsnorm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            # one fused op instead of six: at batch 1 on the CPU a decode step is mostly
            # per-op overhead, and a decoder runs two norms per layer
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)
            return out if residual is None else (out, residual)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight.float() * h).to(dtype)
        return out if residual is None else (out, residual)
