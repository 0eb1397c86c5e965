"""Torch twin of kernels/triton/hyper_connections.py: DeepSeek-V4's hyper-connections (mHC).

Legend: docs/shapes.md (T tokens, C residual streams = `hc_mult`, D hidden). The kernels'
order of operations, in float32:

    f    = streams.flatten()                            [T, C * D]
    mix  = (f @ fn^T) * rsqrt(mean(f^2) + norm_eps)     project first, scale after
    pre  = sigmoid(mix[:C] * scale[0] + base[:C]) + hc_eps
    post = 2 * sigmoid(mix[C:2C] * scale[1] + base[C:2C])
    comb = sinkhorn(mix[2C:].view(C, C) * scale[2] + base[2C:])
    x    = sum_j pre_j * streams_j                      summed in float32, streams' dtype
    out_k = post_k * y + sum_j comb[j, k] * streams_j   in streams' dtype

engine/ops/hyper_connections.py normalises first and then projects (transformers' order):
equal in exact arithmetic, a few float32 ulps apart in rounding.
"""

from __future__ import annotations

import torch


def sinkhorn_reference(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """logits [T, C, C] float32 -> comb [T, C, C]: a row softmax plus eps, one column
    normalisation, then iters - 1 rounds of (rows, columns), eps added to every
    denominator. A fixed count, not a convergence test: 20 rounds leave peaked rows off
    by ~1e-2 (docs/notes-v4.md), and a kernel must stop where the model's code stops."""
    e = torch.exp(logits - logits.amax(dim=-1, keepdim=True))
    comb = e / e.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_mixes_reference(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """streams [T, C, D], fn [rows, C * D] -> the scaled projections [T, rows] float32."""
    flat = streams.flatten(-2).float()  # [T, C*D]
    rstd = torch.rsqrt(flat.square().mean(dim=-1, keepdim=True) + norm_eps)  # [T, 1]
    return (flat @ fn.float().T) * rstd


def hc_collapse_reference(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """pre [T, C] float32, streams [T, C, D] -> sum_j pre_j streams_j [T, D] in streams'
    dtype (summed in float32)."""
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def hc_pre_reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    sinkhorn_iters: int,
    hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, C, D], fn [(2 + C) * C, C * D], base [(2 + C) * C], scale [3] ->
    (x [T, D] streams' dtype, post [T, C] float32, comb [T, C, C] float32)."""
    C = streams.shape[-2]
    mix = hc_mixes_reference(streams, fn, norm_eps)  # [T, (2+C)*C]
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mix[:, :C] * scale[0] + base[:C]) + hc_eps  # [T, C]
    post = 2 * torch.sigmoid(mix[:, C : 2 * C] * scale[1] + base[C : 2 * C])  # [T, C]
    logits = (mix[:, 2 * C :] * scale[2] + base[2 * C :]).unflatten(-1, (C, C))  # [T, C, C]
    comb = sinkhorn_reference(logits, sinkhorn_iters, hc_eps)
    return hc_collapse_reference(pre, streams), post, comb


def hc_post_reference(
    y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """y [T, D], streams [T, C, D], post [T, C], comb [T, C, C] -> [T, C, D]: the
    coefficients cast to streams' dtype, comb^T @ streams rounded once, post_k * y rounded,
    their sum rounded (each step in streams' dtype, as the model's torch code rounds). The
    float32 sum over j runs in stream order, as the kernel adds under the interpreter."""
    dtype = streams.dtype
    comb_d, post_d = comb.to(dtype).float(), post.to(dtype).float()
    x = streams.float()
    mixed = comb_d[:, 0, :, None] * x[:, 0, None, :]  # [T, C (k), D]
    for j in range(1, x.shape[1]):
        mixed = mixed + comb_d[:, j, :, None] * x[:, j, None, :]
    mixed = mixed.to(dtype)
    scaled = (post_d.unsqueeze(-1) * y.to(dtype).float().unsqueeze(-2)).to(dtype)  # [T, C, D]
    return scaled + mixed


def hc_head_reference(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
    hc_eps: float, norm_eps: float,
) -> torch.Tensor:  # fmt: skip
    """streams [T, C, D], fn [C, C * D], base [C], scale [1] -> the head's collapse [T, D]."""
    mix = hc_mixes_reference(streams, fn, norm_eps)  # [T, C]
    pre = torch.sigmoid(mix * scale.float()[0] + base.float()) + hc_eps
    return hc_collapse_reference(pre, streams)
