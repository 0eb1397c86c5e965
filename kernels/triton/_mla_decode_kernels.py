"""Triton bodies for mla_decode.py: split-sequence (flash-decoding) partials, then a merge."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import mma


@triton.jit
def mla_decode_partial_kernel(
    # pointers
    qc_ptr,  # [B, H, KVL]
    qr_ptr,  # [B, H, R]
    cache_ptr,  # [num_blocks, BS, KVL + R]
    block_tables_ptr,  # [B, max_blocks] int32
    ctx_lens_ptr,  # [B] int
    o_ptr,  # [B, H, S, KVL] float32 partial outputs (normalised within the split)
    lse_ptr,  # [B, H, S] float32 log-sum-exp of each split's scores
    # sizes
    H,
    scale,
    # strides
    stride_qcb,
    stride_qch,
    stride_qrb,
    stride_qrh,
    stride_cblk,
    stride_cslot,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    # meta-parameters
    KVL: tl.constexpr,
    R: tl.constexpr,
    BS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_lens_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_T) * BLOCK_T
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, KVL)
    offs_r = tl.arange(0, R)
    qc = tl.load(qc_ptr + b * stride_qcb + offs_h[:, None] * stride_qch + offs_c[None, :],
                 mask=mask_h[:, None], other=0.0)  # fmt: skip
    qr = tl.load(qr_ptr + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :],
                 mask=mask_h[:, None], other=0.0)  # fmt: skip
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, KVL), tl.float32)
    for t0 in range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < end
        page = tl.load(block_tables_ptr + b * stride_bt + offs_t // BS, mask=mask_t, other=0)
        row = cache_ptr + page.to(tl.int64) * stride_cblk + (offs_t % BS) * stride_cslot
        c = tl.load(row[:, None] + offs_c[None, :], mask=mask_t[:, None], other=0.0)  # [T, KVL]
        kr = tl.load(row[:, None] + KVL + offs_r[None, :], mask=mask_t[:, None], other=0.0)
        s = tl.zeros((BLOCK_H, BLOCK_T), tl.float32)
        s = mma(qc, tl.trans(c), s, F32_DOT)
        s = mma(qr, tl.trans(kr), s, F32_DOT)
        s = tl.where(mask_t[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = mma(p.to(c.dtype), c, acc * alpha[:, None], F32_DOT)
        m_i = m_new

    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    o_out = (
        o_ptr + b * stride_ob + offs_h[:, None] * stride_oh + split * stride_os + offs_c[None, :]
    )
    tl.store(o_out, o, mask=mask_h[:, None])
    tl.store(lse_ptr + b * stride_lb + offs_h * stride_lh + split, lse, mask=mask_h)


@triton.jit
def mla_decode_merge_kernel(
    o_part_ptr,  # [B, H, S, KVL] float32
    lse_ptr,  # [B, H, S] float32
    out_ptr,  # [B, H, KVL]
    H,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    KVL: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out = sum_s exp(lse_s - LSE) * o_s: the softmax over the whole context."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(
        lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf")
    )
    w = tl.exp(lse - tl.max(lse, axis=0))
    w = w / tl.sum(w, axis=0)
    offs_c = tl.arange(0, KVL)
    o = tl.load(o_part_ptr + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os
                + offs_c[None, :], mask=mask_s[:, None], other=0.0)  # fmt: skip
    out = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + b * stride_outb + h * stride_outh + offs_c, out.to(out_ptr.dtype.element_ty))
