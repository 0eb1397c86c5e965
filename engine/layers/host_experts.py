"""A MoE layer's routed experts that live in host RAM, in their stored format.

The loader streams a checkpoint one tensor at a time; an expert placed on the host has its
six stored tensors (gate, up and down, each with its scales) staged here in host memory as
they arrive, and as soon as the last one is in, the CPU kernel's store re-lays them into
its own order (kernels/cpu/host_experts.py) and the staged copies are dropped: at most a
few experts are ever held twice, never the layer, and never as bf16.

The kernel reads MXFP4 (E2M1 nibbles + E8M0 scales per 32) and FP8 (E4M3 + 128x128 block
scales); experts in another format cannot be computed on the host.

The store is built under the model's dtype (torch's default dtype while the layer is
built) and keeps it as `compute_dtype`: in a float32 model MXFP4 experts take float32
activations (exact weights, float32 dots), so a split model computes what the all-device
one does up to float32 rounding; in bf16 models they take int8 activations (the fast mode,
well inside bf16's own rounding).

With `compute` "pcie" the experts are kept instead as stored, stacked as the GPU's fused
kernels read them, in pinned memory (engine/layers/pinned_experts.py), for a CUDA step to
copy over and compute there; such a store has no CPU forward.
"""

from __future__ import annotations

import torch

from kernels.formats.e8m0 import check_e8m0

ROLES = ("gate_proj", "up_proj", "down_proj")


class HostExpertStore:
    """Experts `expert_ids` (global ids) of one layer, in host slots 0..n-1 in that order.

    `slot_of` [E] int32 (CPU): each global expert's host slot, -1 for device experts, which
    is what the kernel takes to skip a (token, expert) pair that is not its own."""

    def __init__(
        self,
        expert_ids: tuple[int, ...],
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        format_name: str,
        prefix: str,
        compute: str = "cpu",
    ) -> None:
        from engine.layers.pinned_experts import PinnedStoredExperts
        from kernels.cpu.host_experts import HostFp8Experts, HostMxfp4Experts

        if format_name != "mxfp4" and not format_name.startswith("fp8_block"):
            raise ValueError(
                f"{prefix}: experts stored as {format_name} cannot be computed on the host; "
                "expert offload needs MXFP4 or FP8 experts"
            )
        self.prefix = prefix
        self.format_name = format_name
        self.expert_ids = tuple(expert_ids)
        self.slot_of = torch.full((num_experts,), -1, dtype=torch.int32, device="cpu")
        for slot, expert in enumerate(self.expert_ids):
            self.slot_of[expert] = slot
        self._slot_of_numpy = self.slot_of.numpy()  # the kernel's view of the same memory
        self.compute_dtype = torch.get_default_dtype()
        self.compute = compute
        if compute == "pcie":
            self.kernel_store = PinnedStoredExperts(len(self.expert_ids))
        else:
            kind = HostMxfp4Experts if format_name == "mxfp4" else HostFp8Experts
            self.kernel_store = kind.allocate(len(self.expert_ids), hidden_size, intermediate_size)
            if kind is HostMxfp4Experts:
                self.kernel_store.float32_activations = self.compute_dtype == torch.float32
        self.last_pairs = 0  # (token, expert) pairs the last `forward` computed
        # global expert -> role -> leaf -> staged stored tensor, until the expert is complete
        self._staged: dict[int, dict[str, dict[str, torch.Tensor]]] = {}
        self._leaves: dict[str, tuple[str, ...]] = {}
        self._committed: set[int] = set()

    @property
    def nbytes(self) -> int:
        return int(self.kernel_store.nbytes)

    def forward(self, x, weights, ids, swiglu_limit, out) -> torch.Tensor:
        """out [T, D] = the host experts' weighted share for x [T, D] float32, weights
        [T, K] float32 and global expert ids [T, K] int32 or int64 (contiguous CPU
        tensors): one kernel call (kernels/cpu/host_experts.py host_experts_routed)."""
        from kernels.cpu.host_experts import host_experts_routed

        if self.compute != "cpu":
            raise RuntimeError(
                f"{self.prefix}: host experts kept for copying to the GPU "
                f"(expert_offload_compute={self.compute!r}) have no CPU forward"
            )
        self.last_pairs = host_experts_routed(
            self.kernel_store, self._slot_of_numpy, x, ids, weights, swiglu_limit, out
        )
        return out

    def declare_leaves(self, role: str, leaves: tuple[str, ...]) -> None:
        """The stored tensor names of one projection (`weight` and its scale's name)."""
        self._leaves[role] = leaves

    def staging(self, expert: int, role: str, leaf: str, like: torch.Tensor) -> torch.Tensor:
        """The host tensor expert `expert`'s `role`.`leaf` is copied into (shaped and typed
        as one expert's slice of the stacked parameter `like`)."""
        parts = self._staged.setdefault(expert, {}).setdefault(role, {})
        if leaf not in parts:
            parts[leaf] = torch.empty(like.shape[1:], dtype=like.dtype, device="cpu")
        return parts[leaf]

    def staged(self, expert: int) -> None:
        """Called after each copy into staging: commits the expert once it is complete."""
        parts = self._staged.get(expert, {})
        complete = all(
            set(parts.get(role, {})) >= set(self._leaves.get(role, ("weight",))) for role in ROLES
        )
        if not complete:
            return
        tensors = []
        for role in ROLES:
            weight_leaf, scale_leaf = self._leaves[role]
            scale = parts[role][scale_leaf]
            if scale.dtype == torch.uint8 or self.format_name == "mxfp4":
                check_e8m0(scale, f"{self.prefix}.{expert}.{role}.{scale_leaf}")
            tensors += [parts[role][weight_leaf], scale]
        self.kernel_store.put(int(self.slot_of[expert]), *tensors)
        del self._staged[expert]
        self._committed.add(expert)

    def missing(self) -> list[int]:
        """Host experts whose tensors did not all arrive."""
        return [e for e in self.expert_ids if e not in self._committed]
