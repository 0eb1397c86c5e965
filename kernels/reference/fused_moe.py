"""Torch twin of kernels/triton/fused_moe.py: DeepSeek's loop over experts.

Legend: docs/shapes.md (T tokens, D hidden, I expert intermediate, E experts, K experts
per token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.reference.quant_formats import dequant_fp8_block, dequant_mxfp4


def dequant_experts(w: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """Expert weights [..., N, K] (or packed [..., N, K/2]) -> float32 [..., N, K]."""
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
    topk_weights: torch.Tensor,  # [T, K] float32
    topk_ids: torch.Tensor,  # [T, K] int
    fmt: str = "bf16",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """sum_k weight[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = ids[t, k]. Only the
    experts some token chose are dequantized. float32 math by default (the oracle);
    the benchmark runs it in bf16 as the plain-torch baseline. Result in x's dtype.
    swiglu_limit (V4): gate clamped from above only, up to [-limit, limit], before the
    SiLU."""
    n_experts = w13.shape[0]
    xc = x.to(compute_dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, D]
    counts = torch.bincount(topk_ids.flatten(), minlength=n_experts).tolist()
    for e in range(n_experts):
        if counts[e] == 0:
            continue
        tok, slot = torch.where(topk_ids == e)
        s13 = None if w13_scale is None else w13_scale[e]
        s2 = None if w2_scale is None else w2_scale[e]
        w13e = dequant_experts(w13[e], s13, fmt).to(compute_dtype)  # [2I, D]
        w2e = dequant_experts(w2[e], s2, fmt).to(compute_dtype)  # [D, I]
        inter = w13e.shape[0] // 2
        h = xc[tok] @ w13e.t()  # [n, 2I]
        h = swiglu_reference(h[:, :inter], h[:, inter:], swiglu_limit)  # [n, I]
        y = h @ w2e.t()  # [n, D]
        out.index_add_(0, tok, y.float() * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


def swiglu_reference(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None = None
) -> torch.Tensor:
    """silu(gate) * up; with a limit, min(gate, limit) and up clamped to [-limit, limit]
    first (transformers' DeepseekV4Experts)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
