"""@triton.jit bodies of kernels/triton/rope.py. `rope_heads` is also called from the MLA
cache kernel (_mla_cache_kernels.py), which ropes the query there."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_heads(ptr, stride_t, stride_h, n_heads, tok, cos, sin, offs_h, offs_j,
               HALF: tl.constexpr, INTERLEAVED: tl.constexpr):  # fmt: skip
    """Rotate heads offs_h of token `tok` in place by (cos, sin) [1, BLOCK_J] (pair j:
    (2j, 2j+1) interleaved, (j, j + HALF) neox)."""
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
    rope_heads(q_ptr, stride_qt, stride_qh, n_q_heads, tok, cos, sin, tl.arange(0, BLOCK_HQ),
                offs_j, HALF, INTERLEAVED)  # fmt: skip
    rope_heads(k_ptr, stride_kt, stride_kh, n_k_heads, tok, cos, sin, tl.arange(0, BLOCK_HK),
                offs_j, HALF, INTERLEAVED)  # fmt: skip
