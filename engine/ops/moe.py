"""A DeepSeekMoE block's arithmetic: the interface and its torch implementation.

Legend: docs/shapes.md (T tokens, D hidden, E routed experts, K experts per token).

Dropless: every token is computed by all K of its experts whatever the batch holds. The
torch path groups the (token, slot) pairs by expert (a stable sort plus bincount) and runs
each touched expert once on its rows, dequantizing its stored weight on the fly.

The experts' activation is swiglu below: silu(gate) * up, with V4's `swiglu_limit` clamps
where the config sets one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from engine.ops.device_layer import DeviceSetup, register
from kernels.cpu import batch_invariant


class MoeOps(ABC):
    @abstractmethod
    def forward(self, moe, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] -> the routed experts' weighted sum plus the shared experts, [T, D]
        (in x's dtype, or float32 where the next op, a residual add, takes it).
        `input_ids` [T]: the step's token ids, which a hash-routed layer's router needs."""


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up [.., I]; with a limit (V4's `swiglu_limit`) gate is clamped from
    above only and up to [-limit, limit] first, as transformers' DeepseekV4Experts and
    DeepseekV4MLP do."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return batch_invariant.lanes(F.silu, gate) * up


def routed_experts_forward(
    experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, D], weights [T, K] float32, ids [T, K] -> sum_k weights * expert_k(x)  [T, D].

    Experts run in ascending id order and add into the output with index_add_, the same
    accumulation order as transformers' reference loop, so float32 results agree exactly."""
    T, K = ids.shape
    limit = experts.swiglu_limit
    device_slot_of = experts.gate_proj.device_slot_of
    flat = ids.reshape(-1)  # [T*K]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.num_experts).tolist()
    token_of = order // K  # [T*K] token of each sorted pair
    weight_of = weights.reshape(-1)[order]  # [T*K]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0 or device_slot_of[expert] < 0:  # a host expert: added below
            start += count
            continue
        rows = token_of[start : start + count]
        h = x[rows]  # [n, D]
        act = swiglu(experts.gate_proj(expert, h), experts.up_proj(expert, h), limit)  # [n, I]
        y = experts.down_proj(expert, act) * weight_of[start : start + count, None]  # [n, D]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    if experts.host is not None:
        out += host_experts_part(experts, x, weights, ids).to(out.device, out.dtype)
    return out


def host_experts_part(
    experts,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The host-resident experts' share of the weighted sum, computed by the CPU kernel
    (kernels/cpu/host_experts.py) on host copies: x [T, D], weights [T, K], ids [T, K]
    (global ids) -> [T, D] float32 on the CPU (written into `out` when given). Pairs whose
    expert is on the device add nothing here. Inputs that already are contiguous float32
    (x, weights) and int32/int64 (ids) CPU tensors, as the CUDA backend's pinned buffers
    are, go to the kernel as they are."""
    xf = _host_tensor(x, _FLOAT32)
    if out is None:
        out = torch.empty(xf.shape, dtype=torch.float32)
    return experts.host.forward(
        xf, _host_tensor(weights, _FLOAT32), _host_tensor(ids, _IDS), experts.swiglu_limit, out
    )


_FLOAT32 = (torch.float32,)
_IDS = (torch.int32, torch.int64)


def _host_tensor(t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    """t as a contiguous CPU tensor of one of `dtypes` (the first if it must convert),
    without grad; the same object when it already is one (the kernel then recognises a
    CUDA graph's pinned buffers from call to call)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype not in dtypes or not t.is_cpu:
        t = t.to("cpu", dtypes[0])
    return t if t.is_contiguous() else t.contiguous()


class TorchMoeOps(MoeOps):
    def forward(self, moe, x, input_ids=None):
        weights, ids = moe.gate(x, input_ids)  # [T, K] float32, [T, K]
        if moe.routing_recorder is not None:
            moe.routing_recorder.record(moe.layer_index, ids, moe.experts.bytes_per_expert())
        out = routed_experts_forward(moe.experts, x, weights, ids)
        if moe.shared_experts is not None:
            out = out + moe.shared_experts(x)
        return out


TORCH_MOE = TorchMoeOps()


@register("moe", "cpu")
def torch_moe_ops(moe, setup: DeviceSetup) -> MoeOps:
    return TORCH_MOE
