"""Triton body for mla_prefill.py: the decode kernel's per-query arithmetic
(_mla_decode_kernels) for a tile of Q consecutive queries of one sequence, which read each
cache tile once for all of them. Meta-parameter names as there; M = Q_TILE * BLOCK_H rows,
row m being query m // BLOCK_H's head m % BLOCK_H."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import mma
from kernels.triton._mla_decode_kernels import _load_tile, _value_slice, merge_splits


@triton.jit
def mla_prefill_kernel(
    # pointers
    qc_ptr,  # [T, H, KVL]
    qr_ptr,  # [T, H, R]
    cache_ptr,  # [num_blocks, BS, KVL + R]
    block_tables_ptr,  # [S, max_blocks] int32, one row per sequence
    ctx_lens_ptr,  # [T] int: each query's causal context (its position + 1)
    tile_first_ptr,  # [tiles] int32: the tile's first query row
    tile_rows_ptr,  # [tiles] int32: its queries (1..Q_TILE), consecutive in one sequence
    tile_seq_ptr,  # [tiles] int32: its sequence's row in block_tables
    out_ptr,  # [T, H, KVL]
    o_part_ptr,  # [T, H, S, KVL] float32 partials (normalised within the split)
    lse_ptr,  # [T, H, S] float32
    counters_ptr,  # [tiles * cdiv(H, BLOCK_H) * V_BLOCKS] int32, zero between launches
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
    BLOCK_S: tl.constexpr,
    MERGE_UNROLL: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_V: tl.constexpr,
    Q_TILE: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    hv = tl.program_id(1)
    split = tl.program_id(2)
    V_BLOCKS: tl.constexpr = KVL // BLOCK_V
    M: tl.constexpr = Q_TILE * BLOCK_H
    hb = hv // V_BLOCKS
    v0 = (hv % V_BLOCKS) * BLOCK_V
    first = tl.load(tile_first_ptr + tile)
    nrows = tl.load(tile_rows_ptr + tile)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    offs_m = tl.arange(0, M)
    q_of_m = offs_m // BLOCK_H
    head = hb * BLOCK_H + offs_m % BLOCK_H
    row = (first + q_of_m).to(tl.int64)
    live = (q_of_m < nrows) & (head < H)
    offs_c = tl.arange(0, KVL)
    offs_r = tl.arange(0, R)
    qc = tl.load(qc_ptr + row[:, None] * stride_qcb + head[:, None] * stride_qch + offs_c[None, :],
                 mask=live[:, None], other=0.0)  # fmt: skip
    qr = tl.load(qr_ptr + row[:, None] * stride_qrb + head[:, None] * stride_qrh + offs_r[None, :],
                 mask=live[:, None], other=0.0)  # fmt: skip
    ctx = tl.load(ctx_lens_ptr + row, mask=q_of_m < nrows, other=1).to(tl.int32)
    # Each query's splits by the decode kernel's rule from its own length (same expressions,
    # element by element): its chunks start at multiples of BLOCK_T, so the tile's queries
    # share tile boundaries and the loop below meets each query's tiles in its order.
    tiles = tl.cdiv(ctx, BLOCK_T)
    active = tl.sqrt_rn((2 * tiles).to(tl.float32)).to(tl.int32)
    active = tl.minimum(tl.maximum(active, 1), NUM_SPLITS)
    chunk = tl.maximum(tl.cdiv(tiles, active), 1) * BLOCK_T
    active = tl.maximum(tl.cdiv(ctx, chunk), 1)
    takes = live & (split < active)  # rows this split computes
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)
    lo = tl.min(tl.where(takes, start, 2147483647), axis=0)
    hi = tl.max(tl.where(takes, end, 0), axis=0)
    most = tl.max(tl.where(live, active, 0), axis=0)  # the tile's splits
    if split < most:
        m_i = tl.full((M,), float("-inf"), tl.float32)
        l_i = tl.zeros((M,), tl.float32)
        acc = tl.zeros((M, BLOCK_V), tl.float32)
        pages = block_tables_ptr + seq * stride_bt
        for t0 in range(lo, hi, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            page = tl.load(pages + offs_t // BS, mask=offs_t < hi, other=0)
            c, kr = _load_tile(cache_ptr, page, offs_t, hi, stride_cblk, stride_cslot,
                               KVL, R, BS)  # fmt: skip
            s = tl.zeros((M, BLOCK_T), tl.float32)
            s = mma(qc, tl.trans(c), s, F32_DOT)
            s = mma(qr, tl.trans(kr), s, F32_DOT)
            valid = (
                takes[:, None]
                & (offs_t[None, :] >= start[:, None])
                & (offs_t[None, :] < end[:, None])
            )
            s = tl.where(valid, s * scale, float("-inf"))
            # A row with no slot in this tile keeps its state exactly (the decode kernel
            # never visits such a tile for it); the others update as the decode kernel does.
            has = tl.max(valid.to(tl.int32), axis=1) > 0
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.where(has, tl.exp(m_i - m_new), 1.0)
            p = tl.exp(s - tl.where(has, m_new, 0.0)[:, None])
            l_i = tl.where(has, l_i * alpha + tl.sum(p, axis=1), l_i)
            cv = _value_slice(c, cache_ptr, page, offs_t, hi, stride_cblk, stride_cslot, v0,
                              BS, KVL, BLOCK_V)  # fmt: skip
            updated = mma(p.to(c.dtype), cv, acc * alpha[:, None], F32_DOT)
            acc = tl.where(has[:, None], updated, acc)
            m_i = tl.where(has, m_new, m_i)
        got = l_i > 0
        l_safe = tl.where(got, l_i, 1.0)
        o = acc / l_safe[:, None]
        offs_v = v0 + tl.arange(0, BLOCK_V)
        out_ptrs = (
            out_ptr + row[:, None] * stride_outb + head[:, None] * stride_outh + offs_v[None, :]
        )
        tl.store(out_ptrs, o.to(out_ptr.dtype.element_ty), mask=(takes & (active == 1))[:, None])
        if NUM_SPLITS > 1:  # noqa: SIM102 (a constexpr test; `most` is a runtime value)
            if most > 1:
                split_rows = takes & (active > 1)
                lse = tl.where(got, m_i + tl.log(l_safe), float("-inf"))
                part = o_part_ptr + row[:, None] * stride_ob + head[:, None] * stride_oh
                tl.store(part + split * stride_os + offs_v[None, :], o, mask=split_rows[:, None])
                tl.store(lse_ptr + row * stride_lb + head * stride_lh + split, lse,
                         mask=split_rows)  # fmt: skip
                tl.debug_barrier()
                counter = counters_ptr + tile * tl.num_programs(1) + hv
                arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
                if arrived == most - 1:  # the last split merges each split query
                    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
                    mask_h = offs_h < H
                    for q in range(0, nrows):
                        r = (first + q).to(tl.int64)
                        ctx_q = tl.load(ctx_lens_ptr + r).to(tl.int32)
                        tiles_q = tl.cdiv(ctx_q, BLOCK_T)
                        act = tl.sqrt_rn((2 * tiles_q).to(tl.float32)).to(tl.int32)
                        act = tl.minimum(tl.maximum(act, 1), NUM_SPLITS)
                        chunk_q = tl.maximum(tl.cdiv(tiles_q, act), 1) * BLOCK_T
                        act = tl.maximum(tl.cdiv(ctx_q, chunk_q), 1)
                        if act > 1:
                            part_q = (o_part_ptr + r * stride_ob + offs_h[:, None] * stride_oh
                                      + offs_v[None, :])  # fmt: skip
                            lse_q = lse_ptr + r * stride_lb + offs_h * stride_lh
                            o_q = merge_splits(part_q, lse_q, mask_h, act, stride_os,
                                               BLOCK_H, BLOCK_S, BLOCK_V, MERGE_UNROLL)  # fmt: skip
                            dst = (out_ptr + r * stride_outb + offs_h[:, None] * stride_outh
                                   + offs_v[None, :])  # fmt: skip
                            tl.store(dst, o_q.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
                    tl.atomic_xchg(counter, 0)  # zero again for the next launch
