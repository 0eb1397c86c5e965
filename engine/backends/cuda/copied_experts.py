"""A MoE layer whose host experts are copied to the GPU over PCIe when a step routes to
them (expert_offload_compute "pcie"), then computed by the same fused kernels as the
device ones: the way of running a model larger than the GPU that computing them on the CPU
replaces (engine/backends/cuda/host_experts.py), kept to measure the two side by side.

Per call: the routing's host expert ids come back to the host (a sync: which experts to
copy is data), each distinct one's stored tensors are copied from pinned memory into a
staging stack on the GPU (engine/layers/pinned_experts.py has the layout), and the fused
kernels run the host pairs against the staging stack while the device pairs run against
the layer's own. Such a step cannot be captured as a graph.
"""

from __future__ import annotations

import time

import torch

from engine.backends.cuda.host_experts import HostCallTimes, device_pairs


class CopiedExperts:
    """One layer's host experts, copied in when used. The staging stack is shared by the
    model's layers (one stream runs them in order) and grows to the most distinct host
    experts a call has used."""

    def __init__(self, experts, setup, swiglu_limit, invariant: bool) -> None:
        self.experts = experts
        self.store = experts.host.kernel_store  # PinnedStoredExperts
        # the weights' device: the GPU, or the CPU where tests run the kernels interpreted
        self.device = experts.gate_proj.weight.device
        self.fmt = "mxfp4" if experts.host.format_name == "mxfp4" else "fp8"  # fused_moe's
        self.swiglu_limit = swiglu_limit
        self.invariant = invariant
        self.times = HostCallTimes()
        self.host_slot = experts.host.slot_of.to(self.device)  # [E] int32, -1: device
        slot_of = experts.gate_proj.device_slot_of
        self.device_slot = torch.tensor(slot_of, dtype=torch.int32, device=self.device)
        self.num_device = len(experts.gate_proj.device_ids)
        self.staging: dict = setup.shared("cuda.copied_experts_staging", dict)

    def device_pairs(self, weights: torch.Tensor, ids: torch.Tensor):
        return device_pairs(self.device_slot, weights, ids)

    def _stage(self, n: int) -> tuple[torch.Tensor, ...]:
        """Device stacks for n experts shaped as the pinned ones (shared, grown here)."""
        store = self.store
        key = (tuple(store.w13.shape[1:]), tuple(store.w2.shape[1:]), store.w13.dtype)
        current = self.staging.get(key)
        if current is None or current[0].shape[0] < n:
            current = tuple(
                torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=self.device)
                for t in (store.w13, store.w13_scale, store.w2, store.w2_scale)
            )
            self.staging[key] = current
        return tuple(t[:n] for t in current)

    def forward(self, x, weights, ids, device_experts) -> torch.Tensor:
        """The layer's output: `device_experts()` (float32 [T, D]) plus the host experts'
        share, computed on the GPU after copying the ones this call routes to."""
        from kernels.triton.fused_moe import fused_moe

        on_device = device_experts()
        host_slot = self.host_slot[ids.long()]  # [T, K]
        on_host = host_slot >= 0
        used = torch.unique(host_slot[on_host]).tolist()  # the sync
        t0 = time.perf_counter()
        if not used:
            self.times.add(x.shape[0], time.perf_counter() - t0)
            return on_device
        w13, s13, w2, s2 = self._stage(len(used))
        store = self.store
        for j, e in enumerate(used):
            for dst, src in ((w13, store.w13), (s13, store.w13_scale), (w2, store.w2),
                             (s2, store.w2_scale)):  # fmt: skip
                dst[j].copy_(src[e], non_blocking=True)
        if x.is_cuda:
            torch.cuda.current_stream().synchronize()
        nbytes = len(used) * sum(t[0].numel() * t.element_size() for t in (w13, s13, w2, s2))
        self.times.add(x.shape[0], time.perf_counter() - t0, experts=len(used),
                       pairs=int(on_host.sum()), nbytes=nbytes)  # fmt: skip
        staged_of = torch.zeros(store.num_slots, dtype=torch.int32, device=self.device)
        staged_of[torch.tensor(used, device=self.device)] = torch.arange(
            len(used), dtype=torch.int32, device=self.device
        )
        slots = torch.where(on_host, staged_of[host_slot.clamp(min=0).long()], 0)
        host_weights = torch.where(on_host, weights, torch.zeros_like(weights))
        invariant = {"ordered_combine": True} if self.invariant else {}
        copied = fused_moe(
            x, w13, w2, host_weights, slots.to(torch.int32), self.fmt, s13, s2,
            out_dtype=torch.float32, swiglu_limit=self.swiglu_limit, **invariant,
        )  # fmt: skip
        return on_device + copied
