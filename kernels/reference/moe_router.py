"""Torch twins of kernels/triton/moe_router.py, written after DeepSeek's Gate.forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_route_reference(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    x = logits.float()  # [T, E]
    if scoring == "sigmoid":
        s = x.sigmoid()
    elif scoring == "sqrtsoftplus":
        s = F.softplus(x).sqrt()
    elif scoring == "softmax":
        s = x.softmax(-1)
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    choice = s + bias.float() if bias is not None else s.clone()
    t, e = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(t, n_group, e // n_group)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        drop = torch.ones(t, n_group, dtype=torch.bool, device=x.device)
        drop.scatter_(1, keep_groups, False)
        choice = grouped.masked_fill(drop[..., None], float("-inf")).view(t, e)
    ids = choice.topk(top_k, dim=-1).indices  # [T, k]
    weights = s.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids.to(torch.int32), weights * routed_scaling_factor


def moe_gate_route_reference(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, **routing
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate in float32, as DeepSeek's Gate: logits = x.float() @ W.float().T."""
    logits = x.float() @ gate_weight.float().t()  # [T, E]
    return moe_route_reference(logits, top_k, **routing)
