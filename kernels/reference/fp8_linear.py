"""Torch twin of kernels/triton/fp8_linear.py: dequantize, then a float32 matmul."""

from __future__ import annotations

import torch

from kernels.reference.quant_formats import dequant_fp8_block


def fp8_block_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """x [M, K] @ dequant(weight [N, K], scale)^T -> [M, N] in x's dtype."""
    w = dequant_fp8_block(weight, scale)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def act_quant_reference(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel E4M3 quantization of activations x [M, K]: returns codes
    [M, K] and float32 scales [M, ceil(K/128)] with x ~= q * s (s = amax / 448)."""
    m, k = x.shape
    nb = -(-k // block)
    xp = torch.nn.functional.pad(x.float(), (0, nb * block - k)).view(m, nb, block)
    amax = xp.abs().amax(-1).clamp_min(1e-12)
    s = amax / 448.0
    q = (xp / s[..., None]).to(torch.float8_e4m3fn).view(m, nb * block)[:, :k]
    return q, s
