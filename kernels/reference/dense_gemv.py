"""Torch twin of kernels/triton/dense_gemv.py: a float32 matmul, rounded once."""

from __future__ import annotations

import torch


def dense_gemv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N] in x's dtype, accumulated in float32."""
    return (x.to(torch.float32) @ weight.to(torch.float32).t()).to(x.dtype)
