"""Rotary position embedding applied in place to q and k.

q [T, Hq, R] and k [T, Hk, R] may be views into larger tensors (e.g. the rope slice of a
[T, H, 192] query): any strides over T and heads, contiguous last dim. positions [T] int;
cos, sin [max_pos, R/2] float32 (the engine's cache; YaRN and friends are baked into it).

  interleaved=True  (DeepSeek's stored layout): pairs are (2j, 2j+1), output stays interleaved.
  interleaved=False (neox): pairs are (j, j + R/2).
Pair j rotates by angle j: (a, b) -> (a cos - b sin, a sin + b cos).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import check_device, next_pow2


@triton.jit
def _rope_heads(ptr, stride_t, stride_h, n_heads, tok, cos, sin, offs_h, offs_j,
                HALF: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    mask = (offs_h[:, None] < n_heads) & (offs_j[None, :] < HALF)
    base = ptr + tok * stride_t + offs_h[:, None] * stride_h
    if INTERLEAVED:
        pa = base + 2 * offs_j[None, :]
        pb = pa + 1
    else:
        pa = base + offs_j[None, :]
        pb = pa + HALF
    a = tl.load(pa, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(pb, mask=mask, other=0.0).to(tl.float32)
    tl.store(pa, (a * cos - b * sin).to(ptr.dtype.element_ty), mask=mask)
    tl.store(pb, (a * sin + b * cos).to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    n_q_heads, n_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos,
    HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J)
    cs_mask = offs_j < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_j, mask=cs_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + offs_j, mask=cs_mask, other=0.0)[None, :]
    _rope_heads(q_ptr, stride_qt, stride_qh, n_q_heads, tok, cos, sin, tl.arange(0, BLOCK_HQ),
                offs_j, HALF, INTERLEAVED)  # fmt: skip
    _rope_heads(k_ptr, stride_kt, stride_kh, n_k_heads, tok, cos, sin, tl.arange(0, BLOCK_HK),
                offs_j, HALF, INTERLEAVED)  # fmt: skip


def apply_rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, R] and k [T, Hk, R] in place; returns (q, k)."""
    assert q.dim() == 3 and k.dim() == 3, (
        f"q, k must be [T, H, R], got {list(q.shape)}, {list(k.shape)}"
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
