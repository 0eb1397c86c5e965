"""DeepSeekMoE block: a float32 router, E routed experts stored stacked per layer, and
shared experts added unweighted. The arithmetic is the device's MoE ops
(engine/ops/moe.py; legend: docs/shapes.md).

`swiglu_limit` (V4) clamps the routed and the shared experts' gate and up before the
activation (engine/ops/moe.py swiglu); None (V3) leaves them unclamped. A hash-routed layer
(RouterSpec.hash_routing) needs the step's token ids: forward takes them as `input_ids`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.deepseek_router import DeepseekRouter, RouterSpec
from engine.layers.swiglu_mlp import SwiGluMlp
from engine.ops.device_layer import DeviceLayer, DeviceSetup, build
from engine.ops.moe import TORCH_MOE, MoeOps, routed_experts_forward
from engine.quant.base import QuantConfig
from engine.quant.expert_format import ExpertWeightFormat, UnquantizedExperts


def expert_format(
    quant: QuantConfig | None, prefix: str, in_features: int, out_features: int
) -> ExpertWeightFormat:
    if quant is None:
        return UnquantizedExperts()
    return quant.expert_format_for(prefix, in_features, out_features)


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
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        D, I, E = hidden_size, intermediate_size, num_experts
        dtype = torch.get_default_dtype()
        self.num_experts = E
        self.swiglu_limit = swiglu_limit
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


class DeepseekMoE(nn.Module, DeviceLayer):
    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        n_shared_experts: int,
        spec: RouterSpec,
        quant: QuantConfig | None,
        prefix: str,
        layer_index: int,
        swiglu_limit: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.prefix = prefix
        self.gate = DeepseekRouter(hidden_size, spec)
        self.experts = RoutedExperts(
            spec.num_experts,
            hidden_size,
            moe_intermediate_size,
            quant,
            f"{prefix}.experts",
            swiglu_limit,
        )
        self.shared_experts = (
            SwiGluMlp(
                hidden_size,
                moe_intermediate_size * n_shared_experts,
                quant,
                f"{prefix}.shared_experts",
                swiglu_limit,
            )
            if n_shared_experts
            else None
        )
        # Set by the model when routing statistics are on (engine/routing_stats.py).
        self.routing_recorder = None
        self.ops: MoeOps = TORCH_MOE

    def prepare(self, setup: DeviceSetup) -> None:
        self.ops = build("moe", self, setup)

    def process_weights_after_loading(self) -> None:
        """A hash table naming an expert the layer does not have would make the kernels
        read past the expert weights: refuse it once, at load, naming the tensor."""
        table = self.gate.tid2eid
        if table is None or table.numel() == 0 or table.device.type == "meta":
            return
        low, high = int(table.min()), int(table.max())
        if low < 0 or high >= self.experts.num_experts:
            raise ValueError(
                f"tensor {self.prefix}.gate.tid2eid holds expert ids {low}..{high}; this layer "
                f"has experts 0..{self.experts.num_experts - 1}"
            )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> [T, D]; `input_ids` [T], the step's token ids, is read only by a
        hash-routed layer (which raises without them)."""
        return self.ops.forward(self, x, input_ids)
