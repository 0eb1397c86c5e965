"""DeepSeekMoE block: a float32 router, E routed experts stored stacked per layer, and
shared experts added unweighted. The arithmetic is the device's MoE ops
(engine/ops/moe.py; legend: docs/shapes.md).

`swiglu_limit` (V4) clamps the routed and the shared experts' gate and up before the
activation (engine/ops/moe.py swiglu); None (V3) leaves them unclamped. A hash-routed layer
(RouterSpec.hash_routing) needs the step's token ids: forward takes them as `input_ids`.

Experts an ExpertPlacement puts on the host (engine/expert_placement.py) are not in the
stacked device tensors: those hold the device experts only, in slots 0..n-1 in id order
(`device_slot_of` maps a global expert id to its slot, -1 for a host expert), and the host
experts live in a HostExpertStore (engine/layers/host_experts.py). The loader asks
`expert_tensor` where each expert's stored tensor goes.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.expert_placement import building_placement
from engine.layers.deepseek_router import DeepseekRouter, RouterSpec
from engine.layers.host_experts import HostExpertStore
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
    """One projection (gate, up or down) of a layer's device experts: stored tensors
    [E_device, ...], expert `device_ids[s]` in slot s. `num_experts` counts them all,
    host experts included; methods take global expert ids."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        fmt: ExpertWeightFormat,
        params_dtype: torch.dtype,
        prefix: str,
        host: HostExpertStore | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.in_features, self.out_features = (
            num_experts,
            in_features,
            out_features,
        )
        self.prefix = prefix
        self.format = fmt
        self.host = host
        on_host = set(host.expert_ids) if host is not None else set()
        self.device_ids = tuple(e for e in range(num_experts) if e not in on_host)
        self.device_slot_of = [-1] * num_experts
        for slot, expert in enumerate(self.device_ids):
            self.device_slot_of[expert] = slot
        fmt.create_expert_weights(self, len(self.device_ids), in_features, out_features,
                                  params_dtype)  # fmt: skip
        if host is not None:
            leaves = tuple(name for name, _ in self.named_parameters(recurse=False))
            host.declare_leaves(prefix.rpartition(".")[2], leaves)

    def _slot(self, expert: int) -> int:
        slot = self.device_slot_of[expert]
        if slot < 0:
            raise ValueError(f"{self.prefix}: expert {expert} is computed on the host")
        return slot

    def forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.format.apply_expert(self, self._slot(expert), x)

    def expert_weight(self, expert: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.format.expert_weight(self, self._slot(expert), dtype)

    def expert_tensor(self, leaf: str, expert: int) -> torch.Tensor:
        """Where expert `expert`'s stored tensor `leaf` (`weight`, `scale`, ...) is copied
        at load: its device slot's slice, or host staging; call `expert_loaded` after."""
        param = getattr(self, leaf)
        slot = self.device_slot_of[expert]
        if slot >= 0:
            return param[slot]
        return self.host.staging(expert, self.prefix.rpartition(".")[2], leaf, param)

    def expert_loaded(self, expert: int) -> None:
        if self.device_slot_of[expert] < 0:
            self.host.staged(expert)

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
    """A layer's E routed experts: the device ones stacked in gate/up/down projections,
    the host ones (`host_ids`, from the placement being built) in `host`."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        quant: QuantConfig | None,
        prefix: str,
        swiglu_limit: float | None = None,
        host_ids: tuple[int, ...] = (),
        host_compute: str = "cpu",
    ) -> None:
        super().__init__()
        D, I, E = hidden_size, intermediate_size, num_experts
        dtype = torch.get_default_dtype()
        self.num_experts = E
        self.swiglu_limit = swiglu_limit
        formats = {
            role: expert_format(quant, f"{prefix}.{role}", *shape)
            for role, shape in (("gate_proj", (D, I)), ("up_proj", (D, I)), ("down_proj", (I, D)))
        }
        self.host = (
            HostExpertStore(host_ids, E, D, I, formats["gate_proj"].name, prefix, host_compute)
            if host_ids
            else None
        )

        def projection(role: str, fan_in: int, fan_out: int) -> ExpertProjection:
            return ExpertProjection(
                E, fan_in, fan_out, formats[role], dtype, f"{prefix}.{role}", self.host
            )

        self.gate_proj = projection("gate_proj", D, I)
        self.up_proj = projection("up_proj", D, I)
        self.down_proj = projection("down_proj", I, D)

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
            building_placement().host_experts(layer_index),
            building_placement().compute,
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
