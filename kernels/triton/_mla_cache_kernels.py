"""@triton.jit bodies of kernels/triton/mla_cache.py (the wrapper says what the launch
computes). KVL is kv_lora_rank (R in docs/shapes.md), HALF half the rope dim P."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import mma
from kernels.triton._rope_kernels import rope_heads


@triton.jit
def mla_rope_cache_kernel(
    # pointers
    q_ptr,  # [T, H, P] rope slice of the query (in place)
    kv_ptr,  # [T, KVL + P]
    pos_ptr,  # [T]
    cos_ptr,  # [max_pos, P/2] float32
    sin_ptr,
    norm_w_ptr,  # [KVL] kv_a_layernorm weight
    cache_ptr,  # [slots, KVL + P]
    slot_ptr,  # [T]
    qn_ptr,  # [T, H, N] nope slice of the query (ABSORB)
    w_uk_ptr,  # [H, N, KVL] kv_b's key half (ABSORB)
    qc_ptr,  # [T, H, KVL] out: q_nope @ w_uk per head (ABSORB)
    # sizes
    T,
    n_heads,
    KVL,
    n_nope,
    eps,
    # strides
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_cos,
    stride_cache,
    stride_wh,
    stride_wn,
    stride_ct,
    stride_ch,
    # meta-parameters
    HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_J: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ABSORB: tl.constexpr,
    NOPE: tl.constexpr,  # next_pow2(n_nope) (ABSORB)
    BLOCK_L: tl.constexpr,
    BLOCK_T: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    if ABSORB:  # noqa: SIM102 (a compile-time branch: without ABSORB no absorption code)
        if pid >= T:  # programs T.. absorb: one (head, latent block) each
            absorb_block(qn_ptr, w_uk_ptr, qc_ptr, pid - T, T, KVL, n_nope, stride_qt, stride_qh,
                         stride_wh, stride_wn, stride_ct, stride_ch,
                         NOPE, BLOCK_L, BLOCK_T, F32_DOT)  # fmt: skip
            return
    tok = pid.to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    offs_j = tl.arange(0, BLOCK_J)
    mask_j = offs_j < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + offs_j, mask=mask_j, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + offs_j, mask=mask_j, other=0.0)
    rope_heads(q_ptr, stride_qt, stride_qh, n_heads, tok, cos[None, :], sin[None, :],
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


@triton.jit
def absorb_block(qn_ptr, w_uk_ptr, qc_ptr, blk, T, KVL, n_nope, stride_qt, stride_qh,
                 stride_wh, stride_wn, stride_ct, stride_ch,
                 NOPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_T: tl.constexpr,
                 F32_DOT: tl.constexpr):  # fmt: skip
    """q_c[:, h, l0:l0 + BLOCK_L] = q_nope[:, h, :] @ w_uk[h, :, l0:l0 + BLOCK_L] for every
    token, the weight slice loaded once."""
    lat_blocks = tl.cdiv(KVL, BLOCK_L)
    h = (blk // lat_blocks).to(tl.int64)
    offs_l = (blk % lat_blocks) * BLOCK_L + tl.arange(0, BLOCK_L)
    mask_l = offs_l < KVL
    offs_n = tl.arange(0, NOPE)
    mask_n = offs_n < n_nope
    w = tl.load(w_uk_ptr + h * stride_wh + offs_n[:, None] * stride_wn + offs_l[None, :],
                mask=mask_n[:, None] & mask_l[None, :], other=0.0)  # fmt: skip
    for t0 in range(0, T, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < T
        qn = tl.load(qn_ptr + offs_t[:, None].to(tl.int64) * stride_qt + h * stride_qh
                     + offs_n[None, :], mask=mask_t[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        qc = mma(qn, w.to(qn.dtype), tl.zeros((BLOCK_T, BLOCK_L), tl.float32), F32_DOT)
        # Rounded to the query's dtype as the batched GEMM's output is, then to the cache's.
        qc = qc.to(qn_ptr.dtype.element_ty).to(qc_ptr.dtype.element_ty)
        tl.store(qc_ptr + offs_t[:, None].to(tl.int64) * stride_ct + h * stride_ch
                 + offs_l[None, :], qc, mask=mask_t[:, None] & mask_l[None, :])  # fmt: skip
