"""@triton.jit bodies of kernels/triton/v4_qkv.py: one program per (row, head block) for q
and o, one per row for kv. The rope is interleaved on the last 2 * HALF dims of a head:
pair j is (ROPE0 + 2j, ROPE0 + 2j + 1) with ROPE0 = HEAD_DIM - 2 * HALF; the pairs are
loaded as two strided tiles beside the whole-head tile (they come from L1)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rope_cos_sin(pos_ptr, inv_freq_ptr, row, offs_j, HALF: tl.constexpr,
                 PRECISE_TRIG: tl.constexpr):  # fmt: skip
    """cos, sin [1, BLOCK_J] float32 of angle pos[row] * inv_freq[j], the product formed in
    float32 as the engine's rope_cos_sin does. On a GPU tl.cos / tl.sin may lower to the
    approximate PTX instructions, whose error grows with the angle (positions reach 1e6
    radians at j = 0), so the GPU takes libdevice's cosf / sinf, torch's own; the
    interpreter has no libdevice and computes tl.cos in numpy's float32."""
    inv = tl.load(inv_freq_ptr + offs_j, mask=offs_j < HALF, other=0.0)
    angle = tl.load(pos_ptr + row).to(tl.float32) * inv
    if PRECISE_TRIG:
        cos = libdevice.cos(angle)
        sin = libdevice.sin(angle)
    else:
        cos = tl.cos(angle)
        sin = tl.sin(angle)
    return cos[None, :], sin[None, :]


@triton.jit
def v4_q_prologue_kernel(
    x_ptr, pos_ptr, inv_freq_ptr, q_ptr,  # x [B, H * HEAD_DIM], q [B, H, HEAD_DIM]
    n_heads, eps,
    stride_xb, stride_qb, stride_qh,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PRECISE_TRIG: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, BLOCK_J)
    h_mask = offs_h[:, None] < n_heads
    x_head = x_ptr + row * stride_xb + offs_h[:, None] * HEAD_DIM  # [BLOCK_H, 1]
    q_head = q_ptr + row * stride_qb + offs_h[:, None] * stride_qh
    dtype = q_ptr.dtype.element_ty
    x = tl.load(x_head + offs_d[None, :], mask=h_mask & (offs_d[None, :] < HEAD_DIM), other=0.0)
    x = x.to(tl.float32)
    # unit_rms: the scale in float32, rounded to the model dtype before the product
    scale = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)).to(dtype).to(tl.float32)
    y = (x * scale[:, None]).to(dtype)
    ROPE0: tl.constexpr = HEAD_DIM - 2 * HALF
    tl.store(q_head + offs_d[None, :], y, mask=h_mask & (offs_d[None, :] < ROPE0))
    pair = h_mask & (offs_j[None, :] < HALF)
    pa = ROPE0 + 2 * offs_j[None, :]
    a = tl.load(x_head + pa, mask=pair, other=0.0).to(tl.float32)
    b = tl.load(x_head + pa + 1, mask=pair, other=0.0).to(tl.float32)
    a = (a * scale[:, None]).to(dtype).to(tl.float32)
    b = (b * scale[:, None]).to(dtype).to(tl.float32)
    cos, sin = rope_cos_sin(pos_ptr, inv_freq_ptr, row, offs_j, HALF, PRECISE_TRIG)
    tl.store(q_head + pa, (a * cos - b * sin).to(dtype), mask=pair)
    tl.store(q_head + pa + 1, (b * cos + a * sin).to(dtype), mask=pair)


@triton.jit
def v4_kv_prologue_kernel(
    x_ptr, w_ptr, pos_ptr, inv_freq_ptr, slot_ptr, kv_ptr, ring_ptr,  # x, kv [B, HEAD_DIM]
    eps, ring_size,
    stride_xb, stride_kvb, stride_ring_slot, stride_ring_row,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PRECISE_TRIG: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    offs_j = tl.arange(0, BLOCK_J)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    x_row = x_ptr + row * stride_xb
    kv_row = kv_ptr + row * stride_kvb
    ring_row = ring_ptr + slot * stride_ring_slot + (pos % ring_size) * stride_ring_row
    dtype = kv_ptr.dtype.element_ty
    ring_dtype = ring_ptr.dtype.element_ty
    d_mask = offs_d < HEAD_DIM
    x = tl.load(x_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    # kv_norm as the rmsnorm kernel computes it: x * rstd * w in float32, then rounded
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)  # [1]
    y = (x * rstd[:, None] * w).to(dtype)
    ROPE0: tl.constexpr = HEAD_DIM - 2 * HALF
    nope = offs_d < ROPE0
    tl.store(kv_row + offs_d, y, mask=nope)
    tl.store(ring_row + offs_d, y.to(ring_dtype), mask=nope)
    pair = offs_j[None, :] < HALF
    pa = ROPE0 + 2 * offs_j[None, :]
    a = tl.load(x_row + pa, mask=pair, other=0.0).to(tl.float32)
    b = tl.load(x_row + pa + 1, mask=pair, other=0.0).to(tl.float32)
    wa = tl.load(w_ptr + pa, mask=pair, other=0.0).to(tl.float32)
    wb = tl.load(w_ptr + pa + 1, mask=pair, other=0.0).to(tl.float32)
    a = (a * rstd[:, None] * wa).to(dtype).to(tl.float32)
    b = (b * rstd[:, None] * wb).to(dtype).to(tl.float32)
    cos, sin = rope_cos_sin(pos_ptr, inv_freq_ptr, row, offs_j, HALF, PRECISE_TRIG)
    ra = (a * cos - b * sin).to(dtype)
    rb = (b * cos + a * sin).to(dtype)
    tl.store(kv_row + pa, ra, mask=pair)
    tl.store(kv_row + pa + 1, rb, mask=pair)
    tl.store(ring_row + pa, ra.to(ring_dtype), mask=pair)
    tl.store(ring_row + pa + 1, rb.to(ring_dtype), mask=pair)


@triton.jit
def v4_o_derotate_kernel(
    o_ptr, pos_ptr, inv_freq_ptr, out_ptr,  # o [B, H, HEAD_DIM], out [G, B, H / G * HEAD_DIM]
    n_heads, heads_per_group,
    stride_ob, stride_oh, stride_outg, stride_outb,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, PRECISE_TRIG: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_J: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_j = tl.arange(0, BLOCK_J)
    h_mask = offs_h[:, None] < n_heads
    o_head = o_ptr + row * stride_ob + offs_h[:, None] * stride_oh
    group, within = offs_h // heads_per_group, offs_h % heads_per_group
    out_head = out_ptr + group[:, None] * stride_outg + row * stride_outb
    out_head += within[:, None] * HEAD_DIM
    dtype = out_ptr.dtype.element_ty
    ROPE0: tl.constexpr = HEAD_DIM - 2 * HALF
    nope = h_mask & (offs_d[None, :] < ROPE0)
    x = tl.load(o_head + offs_d[None, :], mask=nope, other=0.0)
    tl.store(out_head + offs_d[None, :], x.to(dtype), mask=nope)
    pair = h_mask & (offs_j[None, :] < HALF)
    pa = ROPE0 + 2 * offs_j[None, :]
    a = tl.load(o_head + pa, mask=pair, other=0.0).to(tl.float32)
    b = tl.load(o_head + pa + 1, mask=pair, other=0.0).to(tl.float32)
    cos, sin = rope_cos_sin(pos_ptr, inv_freq_ptr, row, offs_j, HALF, PRECISE_TRIG)
    # the rope at -pos: (a, b) -> (a cos + b sin, b cos - a sin)
    tl.store(out_head + pa, (a * cos + b * sin).to(dtype), mask=pair)
    tl.store(out_head + pa + 1, (b * cos - a * sin).to(dtype), mask=pair)
