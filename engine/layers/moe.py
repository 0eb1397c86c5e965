"""DeepSeekMoE block: a float32 router, E routed experts stored stacked per layer, and
shared experts added unweighted.

Legend: T = tokens, D = hidden, I = expert intermediate size, E = routed experts,
K = experts per token.

Dropless: every token is computed by all K of its experts whatever the batch holds. The
CPU path groups the (token, slot) pairs by expert (a stable sort plus bincount) and runs
each touched expert once on its rows, dequantizing its stored weight on the fly; a GPU
backend replaces `routed_experts_forward` with a fused kernel over the same stacked tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.deepseek_router import DeepseekRouter, RouterSpec
from engine.layers.swiglu_mlp import SwiGluMlp
from engine.quant.base import QuantConfig
from engine.quant.expert_format import ExpertWeightFormat, UnquantizedExperts


def expert_format(
    quant: QuantConfig | None, prefix: str, in_features: int, out_features: int
) -> ExpertWeightFormat:
    pick = getattr(quant, "expert_format_for", None)
    return pick(prefix, in_features, out_features) if pick else UnquantizedExperts()


class ExpertProjection(nn.Module):
    """One projection (gate, up or down) of all experts: stored tensors [E, ...]."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        fmt: ExpertWeightFormat,
        params_dtype: torch.dtype,
        prefix: str,
    ) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = (
            num_experts,
            in_features,
            out_features,
        )
        self.prefix = prefix
        self.format = fmt
        fmt.create_expert_weights(self, num_experts, in_features, out_features, params_dtype)

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.format.apply_expert(self, expert, x)

    def expert_weight(self, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.format.expert_weight(self, expert, dtype)

    def bytes_per_expert(self) -> int:
        return self.format.bytes_per_expert(self)

    def process_weights_after_loading(self) -> None:
        self.format.process_expert_weights_after_loading(self, self.prefix)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, in={self.in_features}, out={self.out_features}, "
            f"format={self.format.name}"
        )


class RoutedExperts(nn.Module):
    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        quant: QuantConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        D, I, E = hidden_size, intermediate_size, num_experts
        dtype = torch.get_default_dtype()
        self.num_experts = E
        self.gate_proj = ExpertProjection(
            E, D, I, expert_format(quant, f"{prefix}.gate_proj", D, I), dtype, f"{prefix}.gate_proj"
        )
        self.up_proj = ExpertProjection(
            E, D, I, expert_format(quant, f"{prefix}.up_proj", D, I), dtype, f"{prefix}.up_proj"
        )
        self.down_proj = ExpertProjection(
            E, I, D, expert_format(quant, f"{prefix}.down_proj", I, D), dtype, f"{prefix}.down_proj"
        )

    def bytes_per_expert(self) -> int:
        return sum(p.bytes_per_expert() for p in (self.gate_proj, self.up_proj, self.down_proj))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return routed_experts_forward(self, x, weights, ids)


def routed_experts_forward(
    experts: RoutedExperts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, D], weights [T, K] float32, ids [T, K] -> sum_k weights * expert_k(x)  [T, D].

    Experts run in ascending id order and add into the output with index_add_, the same
    accumulation order as transformers' reference loop, so float32 results agree exactly."""
    T, K = ids.shape
    flat = ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    token_of = order // K  # [T*K] token of each sorted pair
    weight_of = weights.reshape(-1)[order]  # [T*K]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = token_of[start : start + count]
        h = x[rows]  # [n, D]
        act = F.silu(experts.gate_proj(expert, h)) * experts.up_proj(expert, h)  # [n, I]
        y = experts.down_proj(expert, act) * weight_of[start : start + count, None]  # [n, D]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


class DeepseekMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        n_shared_experts: int,
        spec: RouterSpec,
        quant: QuantConfig | None,
        prefix: str,
        layer_index: int,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.gate = DeepseekRouter(hidden_size, spec)
        self.experts = RoutedExperts(
            spec.num_experts, hidden_size, moe_intermediate_size, quant, f"{prefix}.experts"
        )
        self.shared_experts = (
            SwiGluMlp(
                hidden_size,
                moe_intermediate_size * n_shared_experts,
                quant,
                f"{prefix}.shared_experts",
            )
            if n_shared_experts
            else None
        )
        # Set by the model when routing statistics are on (engine/routing_stats.py).
        self.routing_recorder = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # GPU backend: router kernel + fused MoE (engine/backends/cuda.py)
            from engine.backends.cuda import moe_forward

            return moe_forward(self, x)
        weights, ids = self.gate(x)  # [T, K] float32, [T, K]
        if self.routing_recorder is not None:
            self.routing_recorder.record(self.layer_index, ids, self.experts.bytes_per_expert())
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
