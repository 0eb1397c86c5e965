"""Torch twin of kernels/triton/fused_moe.py: DeepSeek's loop over experts.

Legend: T tokens, D hidden, I expert intermediate, E experts, A experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference.quant_formats import dequant_fp8_block, dequant_mxfp4


def dequant_experts(w: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """Stacked expert weights [E, N, K] (or packed [E, N, K/2]) -> float32 [E, N, K]."""
    if fmt == "bf16":
        return w.float()
    if fmt == "fp8":
        return dequant_fp8_block(w, scale)
    if fmt == "mxfp4":
        return dequant_mxfp4(w, scale)
    raise ValueError(f"unknown expert weight format {fmt!r} (bf16, fp8, mxfp4)")


def fused_moe_reference(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D] gate rows then up rows (or the stored codes)
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, A] float32
    topk_ids: torch.Tensor,  # [T, A] int
    fmt: str = "bf16",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum_a weight[t, a] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, a]; float32
    math, result in x's dtype."""
    w13f = dequant_experts(w13, w13_scale, fmt)  # [E, 2I, D]
    w2f = dequant_experts(w2, w2_scale, fmt)  # [E, D, I]
    n_experts, two_i, _ = w13f.shape
    inter = two_i // 2
    xf = x.float()
    out = torch.zeros_like(xf)  # [T, D]
    counts = torch.bincount(topk_ids.flatten(), minlength=n_experts).tolist()
    for e in range(n_experts):
        if counts[e] == 0:
            continue
        tok, slot = torch.where(topk_ids == e)
        h = xf[tok] @ w13f[e].t()  # [n, 2I]
        h = F.silu(h[:, :inter]) * h[:, inter:]  # [n, I]
        y = h @ w2f[e].t()  # [n, D]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)
