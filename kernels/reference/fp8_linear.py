"""Torch twins of kernels/triton/fp8_linear.py: dequantize, then a float32 matmul.

Legend: docs/shapes.md (a GEMM's y [M, OUT] = x [M, IN] @ W[OUT, IN]^T).
"""

from __future__ import annotations

import torch

from kernels.reference.quant_formats import dequant_fp8_block
from kernels.reference.rmsnorm import rmsnorm_reference


def fp8_block_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """x [M, IN] @ dequant(weight [OUT, IN], scale)^T -> [M, OUT] in x's dtype."""
    w = dequant_fp8_block(weight, scale)
    return (x.to(torch.float32) @ w.t()).to(x.dtype)


def act_quant_reference(x: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-channel E4M3 quantization of activations x [M, IN]: returns codes
    [M, IN] and float32 scales [M, ceil(IN/128)] with x ~= q * s (s = amax / 448)."""
    m, k = x.shape
    nb = -(-k // block)
    xp = torch.nn.functional.pad(x.float(), (0, nb * block - k)).view(m, nb, block)
    amax = xp.abs().amax(-1).clamp_min(1e-12)
    s = amax / 448.0
    q = (xp / s[..., None]).to(torch.float8_e4m3fn).view(m, nb * block)[:, :k]
    return q, s


def fp8_gemv_rmsnorm_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) @ dequant(weight)^T, x + residual), both in the residual's
    dtype: x [M, IN] float32 or the residual's dtype, residual [M, IN], norm_weight [IN],
    weight [OUT, IN]. The sum is rounded once to the residual's dtype and the normalised
    row again, as kernels/triton/rmsnorm.py feeding the GEMV would round them."""
    y, new_residual = rmsnorm_reference(x, norm_weight, eps, residual)
    return fp8_block_linear_reference(y, weight, scale), new_residual
