"""The MoE router after the gate matmul, as one kernel: one program per token.

  s = score(logits)               sigmoid (V3), sqrtsoftplus (V4: sqrt(softplus)) or softmax
  choice = s + bias               e_score_correction_bias steers selection only
  n_group > 1: group score = sum of its top-2 `choice`; keep the topk_group best groups
  ids = top_k of `choice` over the kept experts (others -inf, as DeepSeek's reference does)
  weights = s[ids]; if norm_topk_prob: / (sum + 1e-20); then * routed_scaling_factor

Returns topk_ids [T, top_k] int32 and topk_weights [T, top_k] float32, ordered by choice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import check_device, next_pow2

SCORING = {"sigmoid": 0, "sqrtsoftplus": 1, "softmax": 2}


@triton.jit
def moe_router_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] float32 (HAS_BIAS)
    ids_ptr,  # [T, TOP_K] int32
    weights_ptr,  # [T, TOP_K] float32
    E,
    stride_l,
    scaling,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if SCORING == 0:
        s = 1.0 / (1.0 + tl.exp(-x))
    elif SCORING == 1:
        softplus = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
        s = tl.sqrt(softplus)
    else:
        ex = tl.exp(x - tl.max(x, axis=0))
        s = ex / tl.sum(ex, axis=0)
    s = tl.where(mask, s, 0.0)
    choice = s
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=mask, other=0.0)
    neg_inf = float("-inf")
    choice = tl.where(mask, choice, neg_inf)

    if N_GROUP > 1:
        group_size = E // N_GROUP
        group = offs // group_size
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_G,), neg_inf, tl.float32)
        for grp in tl.static_range(N_GROUP):
            in_grp = tl.where(group == grp, choice, neg_inf)
            first = tl.argmax(in_grp, axis=0)
            top1 = tl.max(in_grp, axis=0)
            top2 = tl.max(tl.where(offs == first, neg_inf, in_grp), axis=0)
            group_scores = tl.where(offs_g == grp, top1 + top2, group_scores)
        keep = tl.zeros((BLOCK_E,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(group_scores, axis=0)
            keep = keep | (group == best)
            group_scores = tl.where(offs_g == best, neg_inf, group_scores)
        choice = tl.where(keep, choice, neg_inf)

    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        w = tl.sum(tl.where(offs == best, s, 0.0), axis=0)
        ids = tl.where(offs_k == j, best.to(tl.int32), ids)
        weights = tl.where(offs_k == j, w, weights)
        choice = tl.where(offs == best, neg_inf, choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling
    kmask = offs_k < TOP_K
    tl.store(ids_ptr + row * TOP_K + offs_k, ids, mask=kmask)
    tl.store(weights_ptr + row * TOP_K + offs_k, weights, mask=kmask)


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the gate matmul's output) -> (topk_ids [T, top_k] int32,
    topk_weights [T, top_k] float32). Field names follow DeepSeek's config.json."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be a row-major [T, E]"
    t, e = logits.shape
    assert scoring in SCORING, f"scoring must be one of {list(SCORING)}, got {scoring!r}"
    assert 1 <= top_k <= e, f"top_k must be in [1, {e}], got {top_k}"
    assert e % n_group == 0, f"n_routed_experts {e} is not divisible by n_group {n_group}"
    if n_group > 1:
        assert 1 <= topk_group <= n_group, f"topk_group must be in [1, {n_group}], got {topk_group}"
        assert top_k <= topk_group * (e // n_group), "top_k exceeds the experts in the kept groups"
    if bias is not None:
        assert bias.shape == (e,), f"e_score_correction_bias must be [{e}], got {list(bias.shape)}"
        bias = bias.float().contiguous()
    check_device(logits)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        moe_router_kernel[(t,)](
            logits, bias if bias is not None else logits, ids, weights,
            e, logits.stride(0), float(routed_scaling_factor),
            SCORING=SCORING[scoring], HAS_BIAS=bias is not None,
            N_GROUP=n_group if topk_group < n_group else 1, TOPK_GROUP=topk_group,
            TOP_K=top_k, NORM=norm_topk_prob,
            BLOCK_E=next_pow2(e), BLOCK_G=next_pow2(n_group), BLOCK_K=next_pow2(top_k),
            num_warps=4 if e > 128 else 1,
        )  # fmt: skip
    return ids, weights
