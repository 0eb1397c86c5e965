"""RMSNorm's arithmetic: the interface and its torch implementation (float32, as the
reference implementations compute it)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from engine.ops.device_layer import DeviceSetup, register


class NormOps(ABC):
    @abstractmethod
    def forward(self, norm, x: torch.Tensor, residual: torch.Tensor | None):
        """norm(x) with `norm`'s weight and eps; with `residual`, (norm(x + residual),
        x + residual): the fused form the decoder layers use, so the sum is formed once."""


class TorchNormOps(NormOps):
    def forward(self, norm, x, residual):
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            # one fused op instead of six: at batch 1 on the CPU a decode step is mostly
            # per-op overhead, and a decoder runs two norms per layer
            out = F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)
            return out if residual is None else (out, residual)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
        out = (norm.weight.float() * h).to(dtype)
        return out if residual is None else (out, residual)


TORCH_NORM = TorchNormOps()


@register("rmsnorm", "cpu")
def torch_norm_ops(norm, setup: DeviceSetup) -> NormOps:
    return TORCH_NORM
