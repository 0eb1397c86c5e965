"""Host experts kept in their stored format and the device's stacked layout, in pinned host
memory, for copying to the GPU when a step routes to them (expert_offload_compute "pcie":
the way of running a model larger than the GPU that computing host experts on the CPU
replaces, kept so the two can be measured side by side).

One layer's host experts, slots 0..n-1 in HostExpertStore's order, as the fused kernels
read a device layer (engine/backends/cuda/expert_stacking.py): `w13` [n, 2I, ...] gate rows
then up rows, `w2` [n, D, ...], and their scales stacked the same way. Pinned, so a copy
to the GPU runs at the link's speed and does not block the host.
"""

from __future__ import annotations

import torch


class PinnedStoredExperts:
    """`put` each expert as the loader completes it; the stacks are allocated at the first
    one, shaped and typed by its tensors (MXFP4 nibbles + E8M0 scales, or FP8 + block
    scales alike)."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.w13: torch.Tensor | None = None
        self.w13_scale: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None
        self.w2_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        stacks = (self.w13, self.w13_scale, self.w2, self.w2_scale)
        return sum(t.numel() * t.element_size() for t in stacks if t is not None)

    def _stack(self, rows: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        return torch.empty(
            (self.num_slots, *rows), dtype=like.dtype, pin_memory=torch.cuda.is_available()
        )

    def put(self, slot, gate_w, gate_s, up_w, up_s, down_w, down_s) -> None:
        """One expert's six stored tensors (gate, up, down; each weight then its scale)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        if gate_w.shape != up_w.shape or gate_s.shape != up_s.shape:
            raise ValueError(
                f"slot {slot}: gate {list(gate_w.shape)}/{list(gate_s.shape)} and up "
                f"{list(up_w.shape)}/{list(up_s.shape)} differ"
            )
        if self.w13 is None:
            self.w13 = self._stack((2 * gate_w.shape[0], *gate_w.shape[1:]), gate_w)
            self.w13_scale = self._stack((2 * gate_s.shape[0], *gate_s.shape[1:]), gate_s)
            self.w2 = self._stack(tuple(down_w.shape), down_w)
            self.w2_scale = self._stack(tuple(down_s.shape), down_s)
        rows, scale_rows = gate_w.shape[0], gate_s.shape[0]
        self.w13[slot, :rows] = gate_w
        self.w13[slot, rows:] = up_w
        self.w13_scale[slot, :scale_rows] = gate_s
        self.w13_scale[slot, scale_rows:] = up_s
        self.w2[slot] = down_w
        self.w2_scale[slot] = down_s
