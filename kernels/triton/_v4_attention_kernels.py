"""Triton bodies for v4_attention.py: a split kernel (one program per row, head group and
split of the row's visible keys, online softmax) and a combine kernel (the splits'
partials and the sink into the output). Meta-parameter names: HEAD_DIM is `head_dim`,
RATIO the compress ratio m, BS the paged cache's block_size, MODE 0 sliding, 1 HCA, 2 CSA.

A row's keys are numbered 0 .. n_window + n_entries - 1: first its window in position
order, then its entries (HCA: 0 .. n_entries - 1; CSA: the selection's columns, -1
masked). Both kernels derive the row's split count from its own position only (the
_row_keys and _split_rule helpers), so a row's bits do not depend on its batch or on the
grid's NUM_SPLITS, which only bounds it.
"""

from __future__ import annotations

import triton
import triton.language as tl

SLIDING = tl.constexpr(0)
HCA = tl.constexpr(1)
CSA = tl.constexpr(2)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b. IEEE: float32 operands in full precision (float32 inputs on a GPU, where
    tl.dot would round them to tf32, and every input under the interpreter, whose bf16
    dot is wrong: _common.py); otherwise b's dtype on the tensor cores."""
    if IEEE:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a.to(b.dtype), b, acc)
    return out


@triton.jit
def _row_keys(t, window, index_topk, RATIO: tl.constexpr, MODE: tl.constexpr):
    """(window keys, entry columns) of the query at position t."""
    n_window = tl.minimum(t + 1, window)
    if MODE == HCA:
        n_entries = (t + 1) // RATIO
    elif MODE == CSA:
        n_entries = t * 0 + index_topk
    else:
        n_entries = t * 0
    return n_window, n_entries


@triton.jit
def _split_rule(keys, BLOCK_N: tl.constexpr, SPLIT_TILES: tl.constexpr,
                MAX_SPLITS: tl.constexpr):  # fmt: skip
    """(splits, keys per split) for a row of `keys` >= 1 keys: SPLIT_TILES tiles per split
    up to MAX_SPLITS splits, then longer splits; no split is empty."""
    tiles = tl.cdiv(keys, BLOCK_N)
    splits = tl.minimum(tl.cdiv(tiles, SPLIT_TILES), MAX_SPLITS)
    per = tl.cdiv(tiles, splits)
    return tl.cdiv(tiles, per), per * BLOCK_N


@triton.jit
def _key_rows(ring_row, cache_ptr, bt_row, sel_row, t, n_window, offs, end,
              ring_size, stride_rw, stride_cblk, stride_centry,
              RATIO: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """Row pointers [BLOCK_N] of keys `offs` of the row and which of them exist."""
    live = offs < end
    in_window = offs < n_window
    pos = t - n_window + 1 + offs  # the window's positions, oldest first
    window_rows = ring_row + (pos % ring_size).to(tl.int64) * stride_rw
    ok = live & in_window
    if MODE != SLIDING:
        col = offs - n_window
        is_entry = live & (col >= 0)
        if MODE == CSA:
            w = tl.load(sel_row + col, mask=is_entry, other=-1)
        else:
            w = col
        is_entry = is_entry & (w >= 0)
        token = w * RATIO  # the entry's first token: its block and row in the block
        page = tl.load(bt_row + token // BS, mask=is_entry, other=0)
        entry_rows = (cache_ptr + page.to(tl.int64) * stride_cblk
                      + ((token % BS) // RATIO) * stride_centry)  # fmt: skip
        rows = tl.where(in_window, window_rows, entry_rows)
        ok = ok | is_entry
    else:
        rows = window_rows
    return rows, ok


@triton.jit
def v4_attention_split_kernel(
    # pointers
    q_ptr,  # [B, H, HEAD_DIM]
    ring_ptr,  # [slots, ring_size, HEAD_DIM]
    cache_ptr,  # [num_blocks, BS // RATIO, HEAD_DIM] (sliding: unused)
    positions_ptr,  # [B]
    slots_ptr,  # [B]
    block_tables_ptr,  # [B, max_blocks] int32 (sliding: unused)
    sel_ptr,  # [B, index_topk] int32 (CSA only)
    sinks_ptr,  # [H] float32
    out_ptr,  # [B, H, HEAD_DIM]: written here by rows of one split
    acc_ptr,  # [B, H, NUM_SPLITS, HEAD_DIM] float32, unnormalised (rows of several splits)
    m_ptr,  # [B, H, NUM_SPLITS] float32 running max of the split's scores
    l_ptr,  # [B, H, NUM_SPLITS] float32 sum of exp(score - max)
    # sizes
    H,
    window,
    ring_size,
    index_topk,
    scale,
    # strides
    stride_qb,
    stride_qh,
    stride_rs,
    stride_rw,
    stride_cblk,
    stride_centry,
    stride_bt,
    stride_sel,
    stride_ob,
    stride_oh,
    stride_ab,
    stride_ah,
    stride_as,
    stride_mb,
    stride_mh,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    RATIO: tl.constexpr,
    BS: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    mask_h = offs_h < H
    offs_d = tl.arange(0, HEAD_DIM)
    t = tl.load(positions_ptr + b).to(tl.int32)
    n_window, n_entries = _row_keys(t, window, index_topk, RATIO, MODE)
    keys = n_window + n_entries
    splits, chunk = _split_rule(keys, BLOCK_N, SPLIT_TILES, MAX_SPLITS)
    if split < splits:
        q = tl.load(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None], other=0.0)  # fmt: skip
        ring_row = ring_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_rs
        bt_row = block_tables_ptr + b * stride_bt
        sel_row = sel_ptr + b * stride_sel
        start = split * chunk
        end = tl.minimum(start + chunk, keys)
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, HEAD_DIM), tl.float32)
        for k0 in range(start, end, BLOCK_N):
            offs = k0 + tl.arange(0, BLOCK_N)
            rows, ok = _key_rows(ring_row, cache_ptr, bt_row, sel_row, t, n_window, offs, end,
                                 ring_size, stride_rw, stride_cblk, stride_centry,
                                 RATIO, BS, MODE)  # fmt: skip
            # Zeros where no key is: a stale NaN in an unused ring slot or page must not
            # reach acc through 0 * NaN.
            k = tl.load(rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
            s = _dot(q, tl.trans(k), tl.zeros((BLOCK_H, BLOCK_N), tl.float32), IEEE)
            s = tl.where(ok[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A tile with no key (CSA's -1 columns) leaves m at -inf: shift by 0 there,
            # so exp sees -inf - 0, never -inf - -inf.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_shift)
            p = tl.exp(s - m_shift[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = _dot(p, k, acc * alpha[:, None], IEEE)
            m_i = m_new
        if splits == 1:
            # out = acc e^m / (l e^m + e^sink), shifted by the larger of m and the sink.
            sink = tl.load(sinks_ptr + offs_h, mask=mask_h, other=0.0)
            top = tl.maximum(m_i, sink)
            w = tl.exp(m_i - top)
            o = acc * (w / (tl.exp(sink - top) + l_i * w))[:, None]
            out = out_ptr + b * stride_ob + offs_h[:, None] * stride_oh + offs_d[None, :]
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=mask_h[:, None])
        else:
            part = acc_ptr + b * stride_ab + offs_h[:, None] * stride_ah + split * stride_as
            tl.store(part + offs_d[None, :], acc, mask=mask_h[:, None])
            stats = b * stride_mb + offs_h * stride_mh + split
            tl.store(m_ptr + stats, m_i, mask=mask_h)
            tl.store(l_ptr + stats, l_i, mask=mask_h)


@triton.jit
def v4_attention_combine_kernel(
    # pointers
    positions_ptr,  # [B]
    sinks_ptr,  # [H] float32
    out_ptr,  # [B, H, HEAD_DIM]
    acc_ptr,  # [B, H, NUM_SPLITS, HEAD_DIM] float32
    m_ptr,  # [B, H, NUM_SPLITS] float32
    l_ptr,  # [B, H, NUM_SPLITS] float32
    # sizes
    window,
    index_topk,
    # strides
    stride_ob,
    stride_oh,
    stride_ab,
    stride_ah,
    stride_as,
    stride_mb,
    stride_mh,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    RATIO: tl.constexpr,
    MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_TILES: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
):
    """One program per (row, head): out = sum_s acc_s e^(m_s - top) / (e^(sink - top) +
    sum_s l_s e^(m_s - top)), top the largest of the sink and the splits' maxima. Rows of
    one split were finished by the split kernel. The sums run over the row's splits in
    order, one at a time, so NUM_SPLITS (the buffers' width) does not enter the rounding."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    t = tl.load(positions_ptr + b).to(tl.int32)
    n_window, n_entries = _row_keys(t, window, index_topk, RATIO, MODE)
    splits, _ = _split_rule(n_window + n_entries, BLOCK_N, SPLIT_TILES, MAX_SPLITS)
    if splits > 1:
        stats = b * stride_mb + h * stride_mh
        part = acc_ptr + b * stride_ab + h * stride_ah + tl.arange(0, HEAD_DIM)
        sink = tl.load(sinks_ptr + h)
        top = sink
        for s in range(0, splits):
            top = tl.maximum(top, tl.load(m_ptr + stats + s))
        den = tl.exp(sink - top)
        o = tl.zeros((HEAD_DIM,), tl.float32)
        for s in range(0, splits):
            w = tl.exp(tl.load(m_ptr + stats + s) - top)  # 0 for a split that saw no key
            den += tl.load(l_ptr + stats + s) * w
            o += tl.load(part + s * stride_as) * w
        out = out_ptr + b * stride_ob + h * stride_oh + tl.arange(0, HEAD_DIM)
        tl.store(out, (o / den).to(out_ptr.dtype.element_ty))
