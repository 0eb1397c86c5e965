"""Rotary position embedding applied in place to q and k.

q [T, Hq, P] and k [T, Hk, P] (P the rope dim, docs/shapes.md) may be views into larger
tensors (e.g. the rope slice of a [T, H, N + P] query): any strides over T and heads,
contiguous last dim. positions [T] int; cos, sin [max_pos, P/2] float32 (the engine's
cache; YaRN and friends are baked into it). Torch twin: kernels/reference/rope.py;
kernel bodies: _rope_kernels.py.

  interleaved=True  (DeepSeek's stored layout): pairs are (2j, 2j+1), output stays interleaved.
  interleaved=False (neox): pairs are (j, j + P/2).
Pair j rotates by angle j: (a, b) -> (a cos - b sin, a sin + b cos).
"""

from __future__ import annotations

import torch

from kernels.triton._common import check_device, next_pow2
from kernels.triton._rope_kernels import rope_kernel


def apply_rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, P] and k [T, Hk, P] in place; returns (q, k)."""
    assert q.dim() == 3 and k.dim() == 3, (
        f"q, k must be [T, H, P], got {list(q.shape)}, {list(k.shape)}"
    )
    t, hq, r = q.shape
    assert k.shape[0] == t and k.shape[2] == r, (
        f"k {list(k.shape)} does not match q {list(q.shape)}"
    )
    assert r % 2 == 0, f"rope dim must be even, got {r}"
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "q and k need a contiguous last dim"
    assert positions.shape == (t,), f"positions must be [{t}], got {list(positions.shape)}"
    assert cos.shape == sin.shape and cos.shape[-1] == r // 2, (
        f"cos/sin must be [max_pos, {r // 2}], got {list(cos.shape)}, {list(sin.shape)}"
    )
    assert cos.dtype == torch.float32 and cos.stride(-1) == 1 and sin.stride() == cos.stride()
    check_device(q, k, positions, cos, sin)
    if t:
        rope_kernel[(t,)](
            q, k, positions, cos, sin, hq, k.shape[1],
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            HALF=r // 2, INTERLEAVED=interleaved,
            BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(k.shape[1]), BLOCK_J=next_pow2(r // 2),
        )  # fmt: skip
    return q, k
