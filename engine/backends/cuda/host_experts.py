"""A MoE layer split between the GPU and the host: the GPU computes its resident experts
while the CPU computes the host-resident ones for the same tokens.

Per call: the routing (global expert ids) goes to pinned host memory with the layer's
input, asynchronously, and an event marks when it is there; the GPU's kernels are launched
on the device experts with the ids remapped to their slots; the host waits for the event
only, computes its experts (engine/ops/moe.py host_experts_part, the CPU kernel) while the
GPU runs, and its result comes back through pinned memory to be added.

The fused kernels take every (token, expert) pair they are given, so a pair whose expert
is on the host is pointed at a device expert the same token already reads (or slot 0 when
it has none) with weight 0: it adds nothing and, in the common case, reads no extra bytes.
The host pairs' share comes only from the CPU.

The host wait is a synchronisation the CUDA graph of a decode step cannot hold, so a model
with host experts runs its decode steps eagerly (CudaMoeOps.captures_decode).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.ops.moe import host_experts_part


@dataclass
class _InFlight:
    x: torch.Tensor  # pinned float32 [T, D]
    weights: torch.Tensor  # pinned float32 [T, K]
    ids: torch.Tensor  # pinned int32 [T, K]
    ready: torch.cuda.Event


@dataclass
class SplitTimes:
    """Seconds the host spent per layer call, summed: waiting for the routing and inputs
    to reach pinned memory (`wait_s`), and computing its experts (`cpu_s`)."""

    calls: int = 0
    wait_s: float = 0.0
    cpu_s: float = 0.0
    pairs: int = 0  # (token, expert) pairs computed on the host


class SplitExperts:
    """The GPU-side bookkeeping of one layer's split: the global -> device slot map on the
    device, and the pinned transfers."""

    def __init__(self, experts, device: torch.device) -> None:
        self.experts = experts
        self.times = SplitTimes()
        slot_of = experts.gate_proj.device_slot_of
        self.device_slot = torch.tensor(slot_of, dtype=torch.int32, device=device)
        self.num_device = len(experts.gate_proj.device_ids)

    def device_pairs(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, slot ids) for the fused kernels: host pairs weighted 0 and pointed at
        a device expert of their own token (module docstring). No host sync."""
        slot = self.device_slot[ids.long()]  # [T, K], -1: host
        on_device = slot >= 0
        fallback = slot.max(dim=1, keepdim=True).values.clamp(min=0)  # [T, 1]
        slots = torch.where(on_device, slot, fallback).to(torch.int32)
        return torch.where(on_device, weights, torch.zeros_like(weights)), slots

    def start_host(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> _InFlight:
        """Queue the host's inputs' copy to pinned memory behind the routing; returns at
        once."""
        flight = _InFlight(
            torch.empty(x.shape, dtype=torch.float32, pin_memory=True),
            torch.empty(weights.shape, dtype=torch.float32, pin_memory=True),
            torch.empty(ids.shape, dtype=torch.int32, pin_memory=True),
            torch.cuda.Event(),
        )
        flight.x.copy_(x.float(), non_blocking=True)
        flight.weights.copy_(weights.float(), non_blocking=True)
        flight.ids.copy_(ids.to(torch.int32), non_blocking=True)
        flight.ready.record()
        return flight

    def finish_host(self, flight: _InFlight, device: torch.device) -> torch.Tensor:
        """Wait for the inputs (not for the GPU's experts), compute the host experts on the
        CPU, and return their share [T, D] float32 on the device."""
        t0 = time.perf_counter()
        flight.ready.synchronize()
        t1 = time.perf_counter()
        part = host_experts_part(self.experts, flight.x, flight.weights, flight.ids)
        times = self.times
        times.calls += 1
        times.wait_s += t1 - t0
        times.cpu_s += time.perf_counter() - t1
        times.pairs += int((self.experts.host.slot_of[flight.ids.long()] >= 0).sum())
        return part.pin_memory().to(device, non_blocking=True)
