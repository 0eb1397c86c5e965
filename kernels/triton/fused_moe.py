"""Fused MoE for routed experts: two launches after the grouping step.

Legend: T tokens, D hidden, I expert intermediate, E experts, A experts per token,
P = T*A (token, expert) pairs.

  1. moe_align groups the P pairs by expert, padded to BLOCK_M tiles (torch, no sync).
  2. gate+up: one GEMM over the stacked [E, 2I, D] weight (gate rows first, then up),
     SiLU(gate) * up fused in the epilogue -> h [P, I].
  3. down: h @ W2[e]^T over [E, D, I], times the pair's routing weight -> y [P, D] float32,
     then the combine sums each token's A rows (a second reduction, deterministic).

Weights: "bf16" (or fp16) stacked tensors; "fp8": E4M3 codes with 128x128 block scales per
expert ([E, ceil(N/128), ceil(K/128)], float32 or E8M0 uint8); "mxfp4": packed uint8
[E, N, K/2] with E8M0 scales [E, N, K/32]. Codes are decoded in registers.

Decode shapes (few pairs per expert) use BLOCK_M=16 and narrow N tiles so the few touched
experts' weights are spread over every SM; prefill shapes use larger BLOCK_M. Configs come
from configs/fused_moe.json when tuned for the device, else the heuristic below.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton import configs
from kernels.triton._common import check_device, interpreting
from kernels.triton._fused_moe_kernels import moe_down_kernel, moe_gate_up_kernel
from kernels.triton.moe_align import moe_align

OP = "fused_moe"
WEIGHT_FORMATS = {"bf16": 0, "fp8": 1, "mxfp4": 3}


def default_config(num_pairs: int, num_experts: int, fmt: str) -> dict:
    """Heuristic: BLOCK_M follows the expected pairs per expert."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if per_expert <= 16:
        block_m, block_n, warps, stages = 16, 64, 4, 4
    elif per_expert <= 64:
        block_m, block_n, warps, stages = 32, 64, 4, 3
    else:
        block_m, block_n, warps, stages = 64, 128, 8, 3
    block_k = {"bf16": 64, "fp8": 128, "mxfp4": 32}[fmt]
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                num_warps=warps, num_stages=stages)  # fmt: skip


def shape_key(num_tokens: int, top_k: int, num_experts: int, d: int, i: int, fmt: str) -> str:
    return f"T{configs.m_bucket(num_tokens)}_A{top_k}_E{num_experts}_D{d}_I{i}_{fmt}"


def _check_weight(name, w, scale, fmt, e, n, k):
    if fmt == "bf16":
        assert w.dtype in (torch.bfloat16, torch.float16), f"{name} must be bf16/fp16 for 'bf16'"
        assert w.shape == (e, n, k), f"{name} must be [{e}, {n}, {k}], got {list(w.shape)}"
    elif fmt == "fp8":
        assert w.dtype == torch.float8_e4m3fn, f"{name} must be float8_e4m3fn, got {w.dtype}"
        assert w.shape == (e, n, k), f"{name} must be [{e}, {n}, {k}], got {list(w.shape)}"
        want = (e, triton.cdiv(n, 128), triton.cdiv(k, 128))
        assert scale is not None and scale.shape == want, (
            f"{name} scale must be {list(want)}, got {None if scale is None else list(scale.shape)}"
        )
        assert scale.dtype in (torch.float32, torch.uint8), f"{name} scale: float32 or E8M0 uint8"
    elif fmt == "mxfp4":
        assert k % 32 == 0, f"{name}: MXFP4 needs K divisible by 32, got {k}"
        assert w.dtype == torch.uint8, f"{name} must be packed uint8 for 'mxfp4', got {w.dtype}"
        assert w.shape == (e, n, k // 2), (
            f"{name} must be [{e}, {n}, {k // 2}], got {list(w.shape)}"
        )
        assert scale is not None and scale.dtype == torch.uint8, f"{name} scale must be E8M0 uint8"
        assert scale.shape == (e, n, k // 32), (
            f"{name} scale must be [{e}, {n}, {k // 32}], got {list(scale.shape)}"
        )
    else:
        raise ValueError(
            f"unknown expert weight format {fmt!r}; expected one of {list(WEIGHT_FORMATS)}"
        )
    assert w.stride(-1) == 1 and w.stride(-2) == w.shape[-1], (
        f"{name} must be contiguous per expert"
    )
    if scale is not None:
        assert scale.stride(-1) == 1, f"{name} scale must be row-major"


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    fmt: str = "bf16",
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """x [T, D] bf16/fp16; w13 [E, 2I, D] (gate rows, then up rows); w2 [E, D, I];
    topk_weights [T, A] float32; topk_ids [T, A] int. Returns [T, D] in x's dtype:
    sum_a topk_weights[t, a] * down(silu(gate(x_t)) * up(x_t)) of expert topk_ids[t, a]."""
    assert x.dim() == 2 and x.stride(-1) == 1, f"x must be a row-major [T, D], got {list(x.shape)}"
    assert x.dtype in (torch.bfloat16, torch.float16), f"x must be bf16/fp16, got {x.dtype}"
    t, d = x.shape
    e = w13.shape[0]
    i = w2.shape[-1] * (2 if fmt == "mxfp4" else 1)
    _check_weight("w13", w13, w13_scale, fmt, e, 2 * i, d)
    _check_weight("w2", w2, w2_scale, fmt, e, d, i)
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == t, (
        f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must be [T={t}, A]"
    )
    check_device(x, w13, w2, topk_weights, topk_ids)
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if t == 0:
        return out
    cfg = config or configs.lookup(OP, shape_key(t, top_k, e, d, i, fmt), x.device)
    cfg = dict(cfg) if cfg is not None else default_config(t * top_k, e, fmt)
    if fmt == "fp8":
        assert 128 % cfg["BLOCK_K"] == 0, f"FP8 needs BLOCK_K dividing 128, got {cfg['BLOCK_K']}"
    if fmt == "mxfp4":
        assert cfg["BLOCK_K"] % 32 == 0, (
            f"MXFP4 needs BLOCK_K a multiple of 32, got {cfg['BLOCK_K']}"
        )
    wfmt = WEIGHT_FORMATS[fmt]
    if fmt == "fp8" and w13_scale.dtype == torch.uint8:
        wfmt = 2
    w2fmt = 2 if fmt == "fp8" and w2_scale.dtype == torch.uint8 else WEIGHT_FORMATS[fmt]

    align = moe_align(topk_ids, e, cfg["BLOCK_M"])
    p = align.num_pairs
    max_blocks = align.block_expert.numel()
    route_w = topk_weights.reshape(-1).to(torch.float32)
    h = torch.empty((p, i), dtype=x.dtype, device=x.device)
    y = torch.empty((p, d), dtype=torch.float32, device=x.device)
    s13 = w13_scale if w13_scale is not None else w13  # unused pointer for bf16
    s2 = w2_scale if w2_scale is not None else w2
    s13_strides = (s13.stride(0), s13.stride(1)) if w13_scale is not None else (0, 0)
    s2_strides = (s2.stride(0), s2.stride(1)) if w2_scale is not None else (0, 0)
    launch = dict(num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3))
    meta = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                F32_DOT=interpreting())  # fmt: skip

    moe_gate_up_kernel[(max_blocks, triton.cdiv(i, cfg["BLOCK_N"]))](
        x, w13, s13, h, align.sorted_pairs, align.block_expert,
        p, d, i,
        x.stride(0), w13.stride(0), w13.stride(1), *s13_strides, h.stride(0),
        TOPK=top_k, WFMT=wfmt, **meta, **launch,
    )  # fmt: skip
    moe_down_kernel[(max_blocks, triton.cdiv(d, cfg["BLOCK_N"]))](
        h, w2, s2, route_w, y, align.sorted_pairs, align.block_expert,
        p, d, i,
        h.stride(0), w2.stride(0), w2.stride(1), *s2_strides, y.stride(0),
        WFMT=w2fmt, **meta, **launch,
    )  # fmt: skip
    out.copy_(y.view(t, top_k, d).sum(dim=1))  # the combine: sum over each token's A pairs
    return out
