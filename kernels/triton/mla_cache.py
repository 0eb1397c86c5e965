"""MLA decode prologue in one launch: rope on the query's rope slice (in place), and the
new token's latent cache entry [RMSNorm(c) | rope(k_rot)] written straight into its slot.

Legend: T tokens, H heads, KVL = kv_lora_rank, R = rope dim.
  q_rope [T, H, R]   a view of the query's rope slice; rotated in place
  kv     [T, KVL+R]  kv_a_proj_with_mqa's output: c (not yet normalised), then k_rot
  cache  [slots, KVL+R] (any dtype); entry t goes to row slot_mapping[t]
This replaces five launches per MLA layer (the contiguous copy of c, its RMSNorm, rope,
the cat of the entry and the index_copy into the cache); the unfused code rounds c after
the norm and k_rot after rope to the activation dtype, and so does this kernel, so the
cache holds the same values. kv itself is left as it was.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton._common import check_device, next_pow2
from kernels.triton.rope import _rope_heads


@triton.jit
def mla_rope_cache_kernel(
    # pointers
    q_ptr,  # [T, H, R] rope slice of the query (in place)
    kv_ptr,  # [T, KVL + R]
    pos_ptr,  # [T]
    cos_ptr,  # [max_pos, R/2] float32
    sin_ptr,
    norm_w_ptr,  # [KVL] kv_a_layernorm weight
    cache_ptr,  # [slots, KVL + R]
    slot_ptr,  # [T]
    # sizes
    n_heads,
    KVL,
    eps,
    # strides
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_cos,
    stride_cache,
    # meta-parameters
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = offs_j < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_j, mask=mask_j, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_j, mask=mask_j, other=0.0)
    _rope_heads(q_ptr, stride_qt, stride_qh, n_heads, tok, cos[None, :], sin[None, :],
                tl.arange(0, BLOCK_H), offs_j, HALF, INTERLEAVED)  # fmt: skip
    act = kv_ptr.dtype.element_ty
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    row = cache_ptr + slot * stride_cache
    # latent: RMSNorm in float32, rounded to the activation dtype as the layer would
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < KVL
    c = tl.load(kv_ptr + tok * stride_kvt + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / KVL + eps)
    w = tl.load(norm_w_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    c = (c * rstd * w).to(act)
    tl.store(row + offs_c, c.to(cache_ptr.dtype.element_ty), mask=mask_c)
    # k_rot: one shared head, rotated into the cache (kv keeps its input values)
    k = kv_ptr + tok * stride_kvt + KVL
    if INTERLEAVED:
        ia = 2 * offs_j
        ib = ia + 1
    else:
        ia = offs_j
        ib = offs_j + HALF
    a = tl.load(k + ia, mask=mask_j, other=0.0).to(tl.float32)
    b = tl.load(k + ib, mask=mask_j, other=0.0).to(tl.float32)
    ra = (a * cos - b * sin).to(act)
    rb = (a * sin + b * cos).to(act)
    tl.store(row + KVL + ia, ra.to(cache_ptr.dtype.element_ty), mask=mask_j)
    tl.store(row + KVL + ib, rb.to(cache_ptr.dtype.element_ty), mask=mask_j)


def mla_rope_cache_write_(
    q_rope: torch.Tensor,
    kv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    norm_weight: torch.Tensor,
    eps: float,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotate q_rope [T, H, R] in place and write [rmsnorm(kv[:, :KVL]) | rope(kv[:, KVL:])]
    into cache rows slot_mapping [T] (cache viewed as [slots, KVL + R])."""
    assert q_rope.dim() == 3 and q_rope.stride(-1) == 1, "q_rope must be [T, H, R], last dim dense"
    t, h, r = q_rope.shape
    assert kv.dim() == 2 and kv.shape[0] == t and kv.stride(-1) == 1, (
        f"kv must be [{t}, KVL + {r}] with a dense last dim, got {list(kv.shape)}"
    )
    kvl = kv.shape[1] - r
    assert r % 2 == 0, f"rope dim must be even, got {r}"
    assert norm_weight.shape == (kvl,), f"norm weight must be [{kvl}]"
    assert cache.shape[-1] == kvl + r and cache.is_contiguous(), (
        f"cache must be contiguous with rows of {kvl + r}, got {list(cache.shape)}"
    )
    assert positions.shape == (t,) and slot_mapping.shape == (t,), "positions/slots must be [T]"
    assert cos.dtype == torch.float32 and cos.shape[-1] == r // 2 and sin.stride() == cos.stride()
    check_device(q_rope, kv, positions, cos, sin, norm_weight, cache, slot_mapping)
    if t == 0:
        return
    mla_rope_cache_kernel[(t,)](
        q_rope, kv, positions, cos, sin, norm_weight, cache, slot_mapping,
        h, kvl, float(eps),
        q_rope.stride(0), q_rope.stride(1), kv.stride(0), cos.stride(0), kvl + r,
        HALF=r // 2, INTERLEAVED=interleaved, BLOCK_H=next_pow2(h),
        BLOCK_J=next_pow2(r // 2), BLOCK_C=next_pow2(kvl), num_warps=4,
    )  # fmt: skip
