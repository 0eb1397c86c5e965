"""DeepSeek's MoE router: which k experts each token goes to, and with what weight.

Computed in float32 from the router weight, as DeepSeek's and transformers' code do, so
expert choices match them bit for bit on float32 inputs; the routing itself is the torch
twin in kernels/reference/moe_router.py, which `select_experts` calls with this config.

Legend: docs/shapes.md (T tokens, D hidden, E routed experts, G expert groups, K experts per
token).

- V3 (`scoring_func` sigmoid, `topk_method` noaux_tc): s = sigmoid(x Wg^T); the selection
  uses s + e_score_correction_bias, group-limited (keep the `topk_group` groups whose top-2
  biased scores sum highest); the weights are the unbiased s of the chosen experts,
  normalised over them when `norm_topk_prob`, times `routed_scaling_factor`.
- V2 (`scoring_func` softmax, `topk_method` greedy or group_limited_greedy, group score =
  the group's max): weights are the softmax scores (normalised only if `norm_topk_prob`).
- V4 (`scoring_func` sqrtsoftplus, `topk_method` noaux_tc, no `n_group`): s =
  sqrt(softplus(x Wg^T)); the top-k of s + bias (the checkpoint's `gate.bias`), no groups;
  weights as V3's. Its first `num_hash_layers` layers route by hash (`hash_routing`): the
  experts are `tid2eid[token id]` [vocab, K], no bias; the weights are still s of those
  experts, normalised and scaled (transformers' DeepseekV4HashRouter). Those layers need
  the step's token ids: DeepseekRouter.forward takes them as `input_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.cpu import batch_invariant
from kernels.reference.moe_router import moe_hash_route_reference, moe_route_reference

SCORING_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")
TOPK_METHODS = ("noaux_tc", "greedy", "group_limited_greedy")


@dataclass(frozen=True)
class RouterSpec:
    num_experts: int
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # Hash routing: experts from a [vocab_size, top_k] table by token id (V4's first
    # num_hash_layers layers); topk_method's selection and bias do not apply.
    hash_routing: bool = False
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"scoring_func {self.scoring_func!r}: expected one of {SCORING_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method {self.topk_method!r}: expected one of {TOPK_METHODS}")
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts {self.num_experts} is not divisible by n_group {self.n_group}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in 1..n_group {self.n_group}")
        if self.top_k > self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} > n_routed_experts")
        if self.hash_routing:
            if self.vocab_size < 1:
                raise ValueError("hash routing needs vocab_size (the rows of tid2eid)")
            if self.topk_group < self.n_group:
                raise ValueError("hash routing has no expert groups: n_group must be 1")
        limited = self.uses_groups and self.topk_group < self.n_group
        if limited and self.uses_bias and self.num_experts // self.n_group < 2:
            raise ValueError("group-limited noaux_tc routing needs at least 2 experts per group")

    @property
    def uses_bias(self) -> bool:
        return self.topk_method == "noaux_tc" and not self.hash_routing

    @property
    def uses_groups(self) -> bool:
        return self.topk_method in ("noaux_tc", "group_limited_greedy") and not self.hash_routing


def select_experts(
    logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, K] float32, expert ids [T, K] int64): the
    torch routing (kernels/reference/moe_router.py) with the config's method spelled as
    its arguments, experts in torch.topk's unsorted order as transformers has them."""
    if spec.uses_bias and correction_bias is None:
        raise ValueError("noaux_tc routing needs e_score_correction_bias")
    if spec.hash_routing:
        raise ValueError("hash routing selects by token id: use select_hashed_experts")
    return moe_route_reference(
        logits,
        spec.top_k,
        bias=correction_bias if spec.uses_bias else None,
        n_group=spec.n_group if spec.uses_groups else 1,
        topk_group=spec.topk_group,
        norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.routed_scaling_factor,
        scoring=spec.scoring_func,
        group_score="top2" if spec.uses_bias else "max",
        sorted=False,
    )


def select_hashed_experts(
    logits: torch.Tensor, spec: RouterSpec, input_ids: torch.Tensor, tid2eid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32, input_ids [T], tid2eid [vocab, K] -> (weights [T, K]
    float32, expert ids [T, K] int64), experts in the table's order as transformers has
    them."""
    if input_ids is None:
        raise ValueError("a hash-routed MoE layer needs the step's input_ids")
    if input_ids.numel() != logits.shape[0]:
        raise ValueError(f"{input_ids.numel()} input_ids for {logits.shape[0]} tokens")
    return moe_hash_route_reference(
        logits,
        input_ids,
        tid2eid,
        norm_topk_prob=spec.norm_topk_prob,
        routed_scaling_factor=spec.routed_scaling_factor,
        scoring=spec.scoring_func,
    )


class DeepseekRouter(nn.Module):
    """`weight` [E, D] and, for noaux_tc, `e_score_correction_bias` [E], both float32; for
    hash routing `tid2eid` [vocab, K] int64 instead of the bias."""

    def __init__(self, hidden_size: int, spec: RouterSpec) -> None:
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(
            torch.empty(spec.num_experts, hidden_size, dtype=torch.float32), requires_grad=False
        )
        if spec.uses_bias:
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(spec.num_experts, dtype=torch.float32), requires_grad=False
            )
        else:
            self.e_score_correction_bias = None
        if spec.hash_routing:
            self.tid2eid = nn.Parameter(
                torch.empty(spec.vocab_size, spec.top_k, dtype=torch.int64), requires_grad=False
            )
        else:
            self.tid2eid = None

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (weights [T, K] float32, ids [T, K] int64); `input_ids` [T], the
        step's token ids, is read only by a hash-routed layer."""
        logits = batch_invariant.linear(x.float(), self.weight)  # [T, E]
        if self.spec.hash_routing:
            return select_hashed_experts(logits, self.spec, input_ids, self.tid2eid)
        return select_experts(logits, self.spec, self.e_score_correction_bias)
