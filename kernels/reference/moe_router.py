"""The MoE router in torch: which k experts each token goes to, and with what weight. The
twin of kernels/triton/moe_router.py and the CPU engine's router (engine/layers/
deepseek_router.py adapts its config to these arguments). Written after DeepSeek's
Gate.forward and transformers' DeepSeek-V2/V3 code, in float32, so that expert choices
match theirs bit for bit on float32 inputs.

Legend: docs/shapes.md (T tokens, E routed experts, G expert groups, K experts per token).

  s = score(logits)        sigmoid (V3), softmax (V2) or sqrtsoftplus (V4: sqrt(softplus))
  choice = s + bias        e_score_correction_bias steers the selection only
  groups (n_group > 1 and topk_group < n_group): keep the topk_group best groups by
    "top2": the sum of a group's two best `choice` (V3 noaux_tc); others' experts -inf;
    "max":  a group's best `choice` (V2 group_limited_greedy); others' experts 0.0, as
            transformers' DeepSeek-V2 code fills them (softmax scores are > 0 anyway)
  ids = top_k of `choice`
  weights = s[ids]; if norm_topk_prob: / (sum + 1e-20); then * routed_scaling_factor

Hash routing (V4's first `num_hash_layers` layers, moe_hash_route_reference): the ids are
a fixed table's row for each token, ids = tid2eid[token_ids] (tid2eid [vocab, K]), with no
bias and no groups; the weights are computed from s exactly as above (transformers'
DeepseekV4HashRouter).

Returns (weights [T, K] float32, ids [T, K] int64), the order used everywhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import batch_invariant

GROUP_SCORES = ("top2", "max")


def routing_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """logits [T, E] -> float32 scores [T, E]."""
    x = logits.float()
    # lanes: the same bits for a row whatever the row count (kernels/cpu/batch_invariant)
    if scoring == "sigmoid":
        return batch_invariant.lanes(torch.sigmoid, x)
    if scoring == "softmax":
        return x.softmax(dim=-1)
    if scoring == "sqrtsoftplus":
        return batch_invariant.lanes(lambda v: F.softplus(v).sqrt(), x)
    raise ValueError(f"unknown scoring {scoring!r} (sigmoid, softmax, sqrtsoftplus)")


def moe_route_reference(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
    group_score: str = "top2",
    sorted: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, K] float32, ids [T, K] int64); see the module
    docstring. sorted=True orders each token's experts by `choice`, best first (the
    Triton kernels' order); sorted=False keeps torch.topk's unsorted order, as
    transformers' code does (the CPU engine sums its experts in that order)."""
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score {group_score!r}: expected one of {GROUP_SCORES}")
    scores = routing_scores(logits, scoring)  # [T, E]
    choice = scores if bias is None else scores + bias.float()
    t, e = choice.shape
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(t, n_group, e // n_group)  # [T, G, E/G]
        if group_score == "top2":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        keep_groups = group_scores.topk(topk_group, dim=-1, sorted=sorted).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        keep = keep[:, :, None].expand_as(grouped).reshape(t, e)  # [T, E]
        fill = float("-inf") if group_score == "top2" else 0.0
        choice = choice.masked_fill(~keep, fill)
    ids = choice.topk(top_k, dim=-1, sorted=sorted).indices  # [T, K]
    return _chosen_weights(scores, ids, norm_topk_prob, routed_scaling_factor), ids


def moe_hash_route_reference(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    tid2eid: torch.Tensor,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sqrtsoftplus",
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E], token_ids [T], tid2eid [vocab, K] -> (weights [T, K] float32, ids
    [T, K] int64): each token's experts are its tid2eid row, in the table's order."""
    scores = routing_scores(logits, scoring)  # [T, E]
    ids = tid2eid[token_ids.reshape(-1)].long()  # [T, K]
    return _chosen_weights(scores, ids, norm_topk_prob, routed_scaling_factor), ids


def _chosen_weights(
    scores: torch.Tensor, ids: torch.Tensor, norm_topk_prob: bool, routed_scaling_factor: float
) -> torch.Tensor:
    """scores [T, E], ids [T, K] -> the chosen experts' weights [T, K] float32."""
    weights = scores.gather(1, ids)  # [T, K]
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor


def moe_gate_route_reference(
    x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, **routing
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], gate_weight [E, D]: the gate in float32, as DeepSeek's Gate
    (logits = x.float() @ W.float().T), then moe_route_reference."""
    logits = x.float() @ gate_weight.float().t()  # [T, E]
    return moe_route_reference(logits, top_k, **routing)
