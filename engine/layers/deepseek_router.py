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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.cpu import batch_invariant
from kernels.reference.moe_router import moe_route_reference

SCORING_FUNCS = ("sigmoid", "softmax")
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
        limited = self.uses_groups and self.topk_group < self.n_group
        if limited and self.uses_bias and self.num_experts // self.n_group < 2:
            raise ValueError("group-limited noaux_tc routing needs at least 2 experts per group")

    @property
    def uses_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @property
    def uses_groups(self) -> bool:
        return self.topk_method in ("noaux_tc", "group_limited_greedy")


def select_experts(
    logits: torch.Tensor, spec: RouterSpec, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, K] float32, expert ids [T, K] int64): the
    torch routing (kernels/reference/moe_router.py) with the config's method spelled as
    its arguments, experts in torch.topk's unsorted order as transformers has them."""
    if spec.uses_bias and correction_bias is None:
        raise ValueError("noaux_tc routing needs e_score_correction_bias")
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


class DeepseekRouter(nn.Module):
    """`weight` [E, D] and, for noaux_tc, `e_score_correction_bias` [E], both float32."""

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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = batch_invariant.linear(x.float(), self.weight)  # [T, E]
        return select_experts(logits, self.spec, self.e_score_correction_bias)
