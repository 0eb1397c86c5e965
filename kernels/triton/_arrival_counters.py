"""Zeroed int32 counters that let the last program of a group finish a reduction in the
same launch (no second kernel): each program writes its partial result, then
`tl.atomic_add(counter, 1)`; the one that reads `group_size - 1` combines the partials and
stores 0 back, so the counter is zero again for the next launch.

Because every kernel that uses a counter leaves it at zero, one buffer per device serves
every launch on a stream (launches on one stream do not overlap). Launches that run at the
same time as the main stream's (fused_moe's shared expert on its side stream) name their
own `lane`, which has its own buffer. A CUDA graph bakes the buffer's address into its
kernels, so a buffer is never freed once handed out: a larger request allocates a new one
and keeps the old alive. Allocating zeroed memory inside a graph capture would only zero
it on replay (not for eager calls), so that is an error: run the same call once eagerly
first (the graph runner does, largest batch first).

Counters assume every program that incremented one ran to the end; a kernel aborted
mid-launch leaves them dirty (the process is then unusable anyway).
"""

from __future__ import annotations

import torch

from kernels.triton._common import next_pow2

_BUFFERS: dict[tuple[torch.device, str], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # smaller buffers some captured graph may still use
_MIN_SIZE = 4096


def arrival_counters(device: torch.device, n: int, lane: str = "main") -> torch.Tensor:
    """n zeroed int32 counters on `device` (a view of the lane's persistent buffer)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _BUFFERS.get((device, lane))
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"arrival counters: {n} needed during CUDA graph capture but only "
                f"{0 if buf is None else buf.numel()} exist; run this call once outside "
                "capture (at the largest batch) first"
            )
        if buf is not None:
            _RETIRED.append(buf)
        size = max(_MIN_SIZE, next_pow2(n))
        buf = torch.zeros(size, dtype=torch.int32, device=device)
        _BUFFERS[(device, lane)] = buf
    return buf[:n]
