"""A MoE layer split between the GPU and the host: the GPU computes its resident experts
while the CPU computes the host-resident ones for the same tokens.

Per call, after the routing: the GPU's routed experts (with the ids remapped to their
device slots) and the shared expert run on a side stream, while the main stream copies
the layer's input and routing (global expert ids) to pinned host memory, runs the host
experts (engine/ops/moe.py host_experts_part, the CPU kernel) and copies their share
back; the main stream then joins the side stream and adds the two.

- In a captured decode graph the host work is a host node (engine/backends/cuda/
  host_func.py): the step stays one graph. Its pinned buffers are the same for every
  layer and every graph (stream order keeps them apart: one layer's host node finishes
  before the next layer's copies start, and graphs replay one after another), sized by
  the largest decode step seen eagerly, which the graph runner's warm-up step is.
- Eagerly (prefill, or a model not captured) the host waits on an event for its inputs
  and computes while the GPU's kernels run.

The fused kernels take every (token, expert) pair they are given, so a pair whose expert
is on the host is pointed at a device expert the same token already reads (or slot 0 when
it has none) with weight 0: it adds nothing and, in the common case, reads no extra bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.backends.cuda.host_func import HostFunc
from engine.ops.moe import host_experts_part

# Steps of up to this many tokens share the decode-sized pinned buffers (which graphs
# capture); larger ones (prefill) share a second set.
DECODE_BUFFER_MAX_TOKENS = 1024


def device_pairs(
    device_slot: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, slot ids) for the fused kernels on a layer's device experts, given
    `device_slot` [E] (each global expert's device slot, -1 on the host): host pairs
    weighted 0 and pointed at a device expert of their own token (module docstring). No
    host sync."""
    slot = device_slot[ids.long()]  # [T, K], -1: host
    on_device = slot >= 0
    fallback = slot.max(dim=1, keepdim=True).values.clamp(min=0)  # [T, 1]
    slots = torch.where(on_device, slot, fallback).to(torch.int32)
    return torch.where(on_device, weights, torch.zeros_like(weights)), slots


@dataclass
class HostCallTimes:
    """One split layer's host work, summed per token count of the call (a decode step's
    calls apart from prefill's): calls, seconds of the host's own work (the CPU kernel, or
    the copies for CopiedExperts), seconds it waited for its inputs (eager calls), distinct
    experts and (token, expert) pairs it served, bytes copied. Keyed by token count, so
    its size is bounded by the step sizes a run meets."""

    by_tokens: dict = field(
        default_factory=dict
    )  # tokens -> [calls, s, wait_s, experts, pairs, bytes]

    def add(self, tokens: int, seconds: float, wait_s: float = 0.0, experts: int = 0,
            pairs: int = 0, nbytes: int = 0) -> None:  # fmt: skip
        row = self.by_tokens.setdefault(tokens, [0, 0.0, 0.0, 0, 0, 0])
        for i, v in enumerate((1, seconds, wait_s, experts, pairs, nbytes)):
            row[i] += v

    def per_call(self, tokens: int) -> dict | None:
        """Mean figures of the calls of `tokens` tokens (None: there were none)."""
        row = self.by_tokens.get(tokens)
        if not row:
            return None
        calls = row[0]
        return {"calls": calls, "s": row[1] / calls, "wait_s": row[2] / calls,
                "experts": row[3] / calls, "pairs": row[4] / calls, "bytes": row[5] / calls}  # fmt: skip

    def reset(self) -> None:
        self.by_tokens.clear()


class HostBuffers:
    """Pinned host buffers for one call's transfers, and the device tensor the host
    share comes back into; views [:T] serve a call of T tokens."""

    def __init__(self, tokens: int, hidden: int, top_k: int, device: torch.device) -> None:
        self.tokens = tokens
        self.x = torch.empty((tokens, hidden), dtype=torch.float32, pin_memory=True)
        self.weights = torch.empty((tokens, top_k), dtype=torch.float32, pin_memory=True)
        self.ids = torch.empty((tokens, top_k), dtype=torch.int32, pin_memory=True)
        self.out = torch.empty((tokens, hidden), dtype=torch.float32, pin_memory=True)
        self.device_out = torch.empty((tokens, hidden), dtype=torch.float32, device=device)

    def fits(self, tokens: int, hidden: int, top_k: int) -> bool:
        return tokens <= self.tokens and self.x.shape[1] == hidden and self.ids.shape[1] == top_k


class SplitExperts:
    """One layer's split: the global -> device slot map on the device, the side stream,
    the transfers and the host's share."""

    def __init__(self, experts, setup) -> None:
        self.experts = experts
        self.device = setup.device
        self.times = HostCallTimes()
        # True: host nodes return at once (a benchmark's GPU-only time of a step)
        self.skip_host = False
        slot_of = experts.gate_proj.device_slot_of
        self.device_slot = torch.tensor(slot_of, dtype=torch.int32, device=self.device)
        self.num_device = len(experts.gate_proj.device_ids)
        self.side = setup.shared("cuda.host_experts_side_stream",
                                 lambda: torch.cuda.Stream(setup.device))  # fmt: skip
        # one box per model, shared by its split layers (module docstring)
        self.shared_buffers: dict = setup.shared("cuda.host_experts_buffers", dict)
        self.host_funcs: list[HostFunc] = []  # alive as long as the graphs holding them

    def device_pairs(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return device_pairs(self.device_slot, weights, ids)

    def forward(self, x, weights, ids, device_experts) -> torch.Tensor:
        """The layer's output: `device_experts()` (the GPU's routed + shared experts,
        float32 [T, D]) on the side stream, plus the host's share."""
        x = x.float()  # the host buffers' dtype
        main = torch.cuda.current_stream()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            on_device = device_experts()
        if torch.cuda.is_current_stream_capturing():
            host = self._host_in_stream(x, weights, ids)
        else:
            host = self._host_eager(x, weights, ids)
        main.wait_stream(self.side)
        on_device.record_stream(main)
        return on_device + host

    def _buffers(self, t: int, d: int, k: int, grow: bool) -> HostBuffers:
        """The shared buffers for a call of t tokens: the decode-sized set (which graphs
        capture) or the prefill-sized one, grown by eager calls only."""
        kind = "decode" if t <= DECODE_BUFFER_MAX_TOKENS else "prefill"
        current = self.shared_buffers.get(kind)
        if current is not None and current.fits(t, d, k):
            return current
        if not grow:
            raise RuntimeError(
                f"a captured MoE step of {t} tokens has no host buffers: the decode graphs "
                "must be warmed up eagerly at their size first"
            )
        self.shared_buffers[kind] = HostBuffers(t, d, k, self.device)
        return self.shared_buffers[kind]

    def _compute(self, x, weights, ids, out, wait_s: float = 0.0) -> None:
        if self.skip_host:
            return
        t0 = time.perf_counter()
        host_experts_part(self.experts, x, weights, ids, out)
        seconds = time.perf_counter() - t0
        host = self.experts.host
        experts = int(np.count_nonzero(np.bincount(
            host.slot_of.numpy()[ids.numpy().ravel()] + 1, minlength=len(host.expert_ids) + 1
        )[1:]))  # fmt: skip
        self.times.add(x.shape[0], seconds, wait_s, experts, host.last_pairs)

    def _host_in_stream(self, x, weights, ids) -> torch.Tensor:
        """Copies to pinned memory, the host node, the copy back: all queued on the
        current stream (being captured)."""
        (t, d), k = x.shape, ids.shape[1]
        b = self._buffers(t, d, k, grow=False)
        hx, hw, hi, hout = b.x[:t], b.weights[:t], b.ids[:t], b.out[:t]
        hx.copy_(x, non_blocking=True)
        hw.copy_(weights, non_blocking=True)
        hi.copy_(ids, non_blocking=True)
        func = HostFunc(lambda: self._compute(hx, hw, hi, hout))
        func.launch()
        self.host_funcs.append(func)
        back = b.device_out[:t]
        back.copy_(hout, non_blocking=True)
        return back

    def _host_eager(self, x, weights, ids) -> torch.Tensor:
        """The same transfers, with the host waiting on an event for its inputs and
        computing while the side stream's kernels run."""
        (t, d), k = x.shape, ids.shape[1]
        b = self._buffers(t, d, k, grow=True)
        hx, hw, hi, hout = b.x[:t], b.weights[:t], b.ids[:t], b.out[:t]
        # the previous call's copy back out of these buffers must be done before reuse
        torch.cuda.current_stream().synchronize()
        hx.copy_(x, non_blocking=True)
        hw.copy_(weights, non_blocking=True)
        hi.copy_(ids, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        t0 = time.perf_counter()
        ready.synchronize()
        self._compute(hx, hw, hi, hout, wait_s=time.perf_counter() - t0)
        back = b.device_out[:t]
        back.copy_(hout, non_blocking=True)
        return back
