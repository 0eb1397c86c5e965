"""Triton body for mla_decode.py: split-sequence (flash-decoding) attention whose last split
to finish merges the others' partials in the same launch (no merge kernel). Meta-parameter
names: KVL is kv_lora_rank (R in docs/shapes.md), R the rope dim (P there), S the splits."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import mma


@triton.jit
def _load_tile(cache_ptr, page, offs_t, end, stride_cblk, stride_cslot,
               KVL: tl.constexpr, R: tl.constexpr, BS: tl.constexpr):  # fmt: skip
    """Cache slots offs_t (their pages given): latent [T, KVL] and rope key [T, R], zero
    past `end`."""
    mask_t = offs_t < end
    row = cache_ptr + page.to(tl.int64) * stride_cblk + (offs_t % BS) * stride_cslot
    c = tl.load(row[:, None] + tl.arange(0, KVL)[None, :], mask=mask_t[:, None], other=0.0)
    kr = tl.load(row[:, None] + KVL + tl.arange(0, R)[None, :], mask=mask_t[:, None], other=0.0)
    return c, kr


@triton.jit
def _value_slice(c, cache_ptr, page, offs_t, end, stride_cblk, stride_cslot, v0,
                 BS: tl.constexpr, KVL: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
    """The latent columns [v0, v0 + BLOCK_V) this program multiplies by p: `c` itself when
    it owns them all, else a second load of the slice (an L1 hit: the tile was just read)."""
    if BLOCK_V == KVL:
        return c
    row = cache_ptr + page.to(tl.int64) * stride_cblk + (offs_t % BS) * stride_cslot
    cols = v0 + tl.arange(0, BLOCK_V)
    return tl.load(row[:, None] + cols[None, :], mask=(offs_t < end)[:, None], other=0.0)


@triton.jit
def _attend_chunk(
    qc,  # [BLOCK_H, KVL]
    qr,  # [BLOCK_H, R]
    cache_ptr,
    block_tables_ptr,
    b,
    start,
    end,
    v0,
    scale,
    stride_cblk,
    stride_cslot,
    stride_bt,
    KVL: tl.constexpr,
    R: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    F32_DOT: tl.constexpr,
    PREFETCH: tl.constexpr,  # 1: page indices one tile ahead; 0: each tile's own
):
    """Online softmax over cache slots [start, end): (acc [BLOCK_H, BLOCK_V] unnormalised,
    the output's latent columns [v0, v0 + BLOCK_V); running max m [BLOCK_H], running sum l
    [BLOCK_H]). The scores always take the whole latent."""
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_V), tl.float32)
    pages = block_tables_ptr + b * stride_bt
    # Triton does not pipeline this loop (its tile loads hang off the page-index loads), so
    # PREFETCH 1 does by hand: each tile's page indices are loaded one iteration ahead,
    # beside the previous tile's data (one DRAM round trip per tile instead of two
    # dependent ones, for ~20 registers). Where one program per sequence fills the GPU
    # (PREFETCH 0), those registers would spill and other programs hide the latency.
    offs_t = start + tl.arange(0, BLOCK_T)
    page_next = tl.load(pages + offs_t // BS, mask=(offs_t < end) & (PREFETCH > 0), other=0)
    for t0 in range(start, end, BLOCK_T):
        offs_t = t0 + tl.arange(0, BLOCK_T)
        mask_t = offs_t < end
        if PREFETCH == 1:
            page = page_next
            offs_n = offs_t + BLOCK_T
            page_next = tl.load(pages + offs_n // BS, mask=offs_n < end, other=0)
        else:
            page = tl.load(pages + offs_t // BS, mask=mask_t, other=0)
        c, kr = _load_tile(cache_ptr, page, offs_t, end, stride_cblk, stride_cslot,
                           KVL, R, BS)  # fmt: skip
        s = tl.zeros((BLOCK_H, BLOCK_T), tl.float32)
        s = mma(qc, tl.trans(c), s, F32_DOT)
        s = mma(qr, tl.trans(kr), s, F32_DOT)
        s = tl.where(mask_t[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        cv = _value_slice(c, cache_ptr, page, offs_t, end, stride_cblk, stride_cslot, v0,
                          BS, KVL, BLOCK_V)  # fmt: skip
        acc = mma(p.to(c.dtype), cv, acc * alpha[:, None], F32_DOT)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def merge_splits(part, lse_row, mask_h, active, stride_os,
                 BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_V: tl.constexpr,
                 MERGE_UNROLL: tl.constexpr):  # fmt: skip
    """out = sum_s exp(lse_s - LSE) o_s / sum_s exp(lse_s - LSE) over the `active` splits'
    partials (`part` + s * stride_os, [BLOCK_H, BLOCK_V]) and log-sum-exps (`lse_row` + s).
    Every split's log-sum-exp in one load, then the partials in a loop whose loads do not
    depend on each other, unrolled so several are in flight. Active splits hold >= 1
    token, so every lse is finite. .cg: read at L2, past this SM's L1, which may hold stale
    lines of a buffer another launch used at the same address."""
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(lse_row[:, None] + offs_s[None, :],
                      mask=mask_h[:, None] & (offs_s < active)[None, :],
                      other=float("-inf"), cache_modifier=".cg")  # fmt: skip
    top = tl.max(lse_all, axis=1)
    top = tl.where(mask_h, top, 0.0)  # heads past H: no finite lse
    w_all = tl.exp(lse_all - top[:, None])  # [BLOCK_H, BLOCK_S], 0 past active
    o = tl.zeros((BLOCK_H, BLOCK_V), tl.float32)
    for s in tl.range(0, active, loop_unroll_factor=MERGE_UNROLL):
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w_all, 0.0), axis=1)
        o_s = tl.load(part + s * stride_os, mask=mask_h[:, None], other=0.0,
                      cache_modifier=".cg")  # fmt: skip
        o += o_s * w_s[:, None]
    return o / tl.sum(w_all, axis=1)[:, None]


@triton.jit
def mla_decode_kernel(
    # pointers
    qc_ptr,  # [B, H, KVL]
    qr_ptr,  # [B, H, R]
    cache_ptr,  # [num_blocks, BS, KVL + R]
    block_tables_ptr,  # [B, max_blocks] int32
    ctx_lens_ptr,  # [B] int
    out_ptr,  # [B, H, KVL]
    o_part_ptr,  # [B, H, S, KVL] float32 partial outputs (normalised within the split)
    lse_ptr,  # [B, H, S] float32 log-sum-exp of each split's scores
    counters_ptr,  # [B, cdiv(H, BLOCK_H) * V_BLOCKS] int32, zero between launches
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
    stride_outb,
    stride_outh,
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
    BLOCK_S: tl.constexpr,  # next_pow2(NUM_SPLITS)
    MERGE_UNROLL: tl.constexpr,  # partials in flight while the last split merges
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,  # output latent columns per program (KVL // BLOCK_V per head block)
    F32_DOT: tl.constexpr,
    PREFETCH: tl.constexpr,  # _attend_chunk's, for split sequences
):
    b = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)  # head block x value block
    split = tl.program_id(2)
    V_BLOCKS: tl.constexpr = KVL // BLOCK_V
    hb = hv // V_BLOCKS
    v0 = (hv % V_BLOCKS) * BLOCK_V
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_c = tl.arange(0, KVL)
    offs_v = v0 + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, R)
    # q does not depend on the context length: its loads go out beside the length's, not
    # after the branch that needs it (one DRAM round trip fewer per program).
    qc = tl.load(qc_ptr + b * stride_qcb + offs_h[:, None] * stride_qch + offs_c[None, :],
                 mask=mask_h[:, None], other=0.0)  # fmt: skip
    qr = tl.load(qr_ptr + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :],
                 mask=mask_h[:, None], other=0.0)  # fmt: skip
    ctx = tl.load(ctx_lens_ptr + b).to(tl.int32)
    # Splits this sequence uses, decided here from its device-side length (a CUDA graph
    # fixes NUM_SPLITS at capture for the longest possible context): about sqrt(2 * tiles),
    # which balances the tiles one split streams against the partials the last one merges.
    # Every program of the sequence computes the same `active`.
    tiles = tl.cdiv(ctx, BLOCK_T)
    active = tl.sqrt_rn((2 * tiles).to(tl.float32)).to(tl.int32)  # IEEE: floor exact at squares
    active = tl.minimum(tl.maximum(active, 1), NUM_SPLITS)
    chunk = tl.maximum(tl.cdiv(tiles, active), 1) * BLOCK_T
    active = tl.maximum(tl.cdiv(ctx, chunk), 1)
    if split < active:
        start = split * chunk
        end = tl.minimum(start + chunk, ctx)
        acc, m_i, l_i = _attend_chunk(
            qc, qr, cache_ptr, block_tables_ptr, b, start, end, v0, scale,
            stride_cblk, stride_cslot, stride_bt,
            KVL, R, BS, BLOCK_H, BLOCK_T, BLOCK_V, F32_DOT,
            PREFETCH if NUM_SPLITS > 1 else 0,
        )  # fmt: skip
        has = l_i > 0  # false only for a zero-length context
        l_safe = tl.where(has, l_i, 1.0)
        o = acc / l_safe[:, None]
        out_ptrs = out_ptr + b * stride_outb + offs_h[:, None] * stride_outh + offs_v[None, :]
        if active == 1:
            tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
        elif NUM_SPLITS > 1:  # a constexpr: with 1 no partial buffers or counters exist
            lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
            part = o_part_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_v[None, :]
            lse_row = lse_ptr + b * stride_lb + offs_h * stride_lh
            tl.store(part + split * stride_os, o, mask=mask_h[:, None])
            # Every value block of the split stores the same lse: the merging program
            # then reads values its own block's counter ordered before it.
            tl.store(lse_row + split, lse, mask=mask_h)
            # Every thread's stores before the counter's release (acq_rel at gpu scope).
            tl.debug_barrier()
            counter = counters_ptr + b * tl.num_programs(1) + hv
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == active - 1:  # the last split merges (its own partial re-read too)
                o = merge_splits(part, lse_row, mask_h, active, stride_os,
                                 BLOCK_H, BLOCK_S, BLOCK_V, MERGE_UNROLL)  # fmt: skip
                tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
                tl.atomic_xchg(counter, 0)  # zero again for the next launch
