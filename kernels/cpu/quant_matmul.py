"""y = x W^T on the CPU with W kept as 4-bit integers plus one scale and zero per group of
32 input values, computed by torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`).

That kernel's weight convention is w = (q - 8) * scale + zero, q in 0..15, group-wise along
the input dimension. Both GGUF 4-bit block formats map onto it exactly, and so does Q8_0
after splitting each int8 into two nibbles (see `int8_groups_as_int4`). The kernel reads
activations, scales and zeros in bfloat16 and accumulates in float32; its float32
activation path is ~30x slower on this machine class (measured, docs/notes-cpu-decode.md),
so activations go through bfloat16, like llama.cpp rounding them to 8 bits.

Constraints of the kernel: out_features a multiple of 16, in_features a multiple of the
group size. `Int4Weight.pack` raises ValueError otherwise and callers fall back.

Every row count takes the same kernel, whose rows are computed independently of each other:
a row's result does not depend on how many rows share the call (batch invariance; a bf16
matmul over the decoded weight would be faster for long prefill chunks but rounds
differently, so a prompt's bits would depend on how it was chunked).

Legend: M = rows of x, N = out features, K = in features, G = K / group_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16


def int4_kernel_available() -> bool:
    """Whether this torch build has the int4 CPU kernels (torch >= 2.6 does)."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu"
    )


@dataclass
class Int4Weight:
    """A weight [N, K] packed for the int4 CPU kernel."""

    packed: torch.Tensor  # [N, K / 2] uint8, kernel layout
    scales_zeros: torch.Tensor  # [G, N, 2] bfloat16
    in_features: int
    out_features: int
    group_size: int = GROUP_SIZE

    @classmethod
    def pack(
        cls, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int = GROUP_SIZE
    ) -> Int4Weight:
        """q [N, K] integers in 0..15; scale, zero [N, G]: w = (q - 8) * scale + zero."""
        n, k = q.shape
        if not int4_kernel_available():
            raise ValueError("this torch build has no int4 CPU kernel")
        if n % 16 or k % group_size or k % 2:
            raise ValueError(
                f"int4 CPU kernel needs out_features % 16 == 0 and in_features % {group_size} "
                f"== 0, got [{n}, {k}]"
            )
        if scale.shape != (n, k // group_size) or zero.shape != scale.shape:
            raise ValueError(f"scale/zero must be [{n}, {k // group_size}], got {scale.shape}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(COMPUTE_DTYPE).contiguous()
        return cls(packed, scales_zeros, k, n, group_size)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + (
            self.scales_zeros.numel() * self.scales_zeros.element_size()
        )


def int4_matmul(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x [..., K] -> x W^T [..., N] in x's dtype."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.in_features).to(COMPUTE_DTYPE)  # [M, K]
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        x2, w.packed, w.group_size, w.scales_zeros
    )  # [M, N]
    return y.to(x.dtype).reshape(*lead, w.out_features)


def int4_dequantize(w: Int4Weight) -> torch.Tensor:
    """The weight the kernel actually multiplies by, float32 [N, K]. Runs the kernel in
    float32 on the identity matrix: every output is 1.0 * w exactly (tests and references)."""
    eye = torch.eye(w.in_features, dtype=torch.float32)
    wt = torch.ops.aten._weight_int4pack_mm_for_cpu(
        eye, w.packed, w.group_size, w.scales_zeros.float()
    )  # [K, N]
    return wt.t().contiguous()


def int4_matmul_reference(
    x: torch.Tensor,
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int = GROUP_SIZE,
) -> torch.Tensor:
    """Plain torch twin of `int4_matmul` in float32 (exact scales, exact activations)."""
    n, k = q.shape
    w = (q.float() - 8).reshape(n, k // group_size, group_size) * scale[..., None].float()
    w = (w + zero[..., None].float()).reshape(n, k)  # [N, K]
    return (x.float() @ w.t()).to(x.dtype)


def int8_groups_as_int4(
    q: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewrite w = d * q (q int8 [N, G, 32], d [N, G]) as an int4 weight over doubled
    inputs [x, x]: with u = q + 128 = 16 hi + lo (hi, lo in 0..15),

        d q = 16 d (hi - 8) + [d (lo - 8) + 8 d]

    so the hi nibbles take scale 16 d, zero 0 and the lo nibbles scale d, zero 8 d. Returns
    (q4 [N, 2K], scale [N, 2G], zero [N, 2G]) with the hi half first; multiply it by
    `torch.cat([x, x], -1)`. Exact up to the kernel's bfloat16 scales."""
    n, g, bs = q.shape
    u = (q.to(torch.int16) + 128).to(torch.uint8)  # [N, G, 32] in 0..255
    hi, lo = (u >> 4).reshape(n, g * bs), (u & 0x0F).reshape(n, g * bs)
    d = d.float()
    q4 = torch.cat([hi, lo], dim=1)  # [N, 2K]
    scale = torch.cat([16.0 * d, d], dim=1)  # [N, 2G]
    zero = torch.cat([torch.zeros_like(d), 8.0 * d], dim=1)  # [N, 2G]
    return q4, scale, zero
