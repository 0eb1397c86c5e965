"""Triton bodies for v4_compress.py: the decode-step compressor (one program per row) and
the indexer's scores (one program per row and tile of entries). Meta-parameter names: D is
the entry width d, W the projection width (d, or 2d with OVERLAP), RATIO the compress
ratio m, BS the paged cache's block_size, ROPE_HALF the rope pairs P / 2.

The compressor's channels are handled as two halves, the even ones and the odd ones
([.., D // 2] each): softmax pooling and the norm are per channel, and the rope rotates
the pair (2j, 2j + 1), so pair j's two values sit at the same index of the two halves and
no shuffle is needed.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _cos_sin(angle, ACCURATE_TRIG: tl.constexpr):
    """cos and sin of float32 angles. ACCURATE_TRIG (a GPU): libdevice's cosf / sinf with
    full range reduction (entry angles reach max_model_len * inv_freq[0] radians); the
    interpreter has no libdevice and takes numpy's."""
    if ACCURATE_TRIG:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    return cos, sin


@triton.jit
def _slot_tile(state_row, kv_row, score_row, ape_row, pos, start, slot0, offs_s, chan,
               reach, stride_sr, stride_s2,
               RATIO: tl.constexpr, D: tl.constexpr, OVERLAP: tl.constexpr):  # fmt: skip
    """(kv, score) [BLOCK_S, D // 2] float32 of slots slot0 + offs_s of the window starting
    at `start`, at channels `chan` [D // 2] of the entry (one parity). `_slots`' layout:
    HCA slot i is token start + i; CSA slot i < m is Ca (channels [0, d)) of token
    start - m + i, slot i >= m Cb (channels [d, 2d)) of token start + i - m; window -1's
    slots (token < 0) are kv 0, score -inf. The row's own token (pos) is read from the
    step's inputs, not from the state the same program has just written."""
    i = slot0 + offs_s
    if OVERLAP:
        token = start - RATIO + i
        base = tl.where(i < RATIO, 0, D)
    else:
        token = start + i
        base = i * 0
    col = base[:, None] + chan[None, :]  # [BLOCK_S, D // 2]: the projection's channel
    exists = (token >= 0)[:, None]
    own = (token == pos)[:, None]
    at = state_row + ((token % reach).to(tl.int64) * stride_sr)[:, None] + col
    kv = tl.load(at, mask=exists & ~own, other=0.0)
    score = tl.load(at + stride_s2, mask=exists & ~own, other=float("-inf"))
    kv_own = tl.load(kv_row + col, mask=own, other=0.0).to(tl.float32)
    score_own = tl.load(score_row + col, mask=own, other=0.0).to(tl.float32)
    score_own += tl.load(ape_row + col, mask=own, other=0.0)
    return tl.where(own, kv_own, kv), tl.where(own, score_own, score)


@triton.jit
def v4_compress_decode_kernel(
    # pointers
    kv_ptr,  # [B, W] the token's wkv projection
    score_ptr,  # [B, W] its wgate projection
    ape_ptr,  # [RATIO, W] float32
    state_ptr,  # [slots, 2, reach, W] float32
    cache_ptr,  # [num_blocks, BS // RATIO, D]
    positions_ptr,  # [B]
    slots_ptr,  # [B]
    block_tables_ptr,  # [B, max_blocks] int32
    norm_ptr,  # [D] float32
    inv_freq_ptr,  # [ROPE_HALF] float32
    # sizes
    reach,
    eps,
    # strides
    stride_kv,
    stride_score,
    stride_ss,
    stride_s2,
    stride_sr,
    stride_cblk,
    stride_centry,
    stride_bt,
    # meta-parameters
    D: tl.constexpr,
    W: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    BS: tl.constexpr,
    ROPE_HALF: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ACCURATE_TRIG: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + b).to(tl.int64)
    state_row = state_ptr + tl.load(slots_ptr + b).to(tl.int64) * stride_ss
    kv_row = kv_ptr + b * stride_kv
    score_row = score_ptr + b * stride_score
    ape_row = ape_ptr + (pos % RATIO) * W
    # 1. the token's (kv, score + ape) into its state row
    offs_w = tl.arange(0, W)
    kv = tl.load(kv_row + offs_w).to(tl.float32)
    score = tl.load(score_row + offs_w).to(tl.float32) + tl.load(ape_row + offs_w)
    row = state_row + (pos % reach) * stride_sr + offs_w
    tl.store(row, kv)
    tl.store(row + stride_s2, score)
    # 2. a token closing its window pools it into the window's entry
    if pos % RATIO == RATIO - 1:
        S: tl.constexpr = 2 * RATIO if OVERLAP else RATIO
        HALF: tl.constexpr = D // 2
        start = pos - (RATIO - 1)
        offs_s = tl.arange(0, BLOCK_S)
        even = 2 * tl.arange(0, HALF)
        odd = even + 1
        # per channel: the slots' max, then sum e^(s - max) and sum kv e^(s - max)
        max_e = tl.full((HALF,), float("-inf"), tl.float32)
        max_o = tl.full((HALF,), float("-inf"), tl.float32)
        for s0 in range(0, S, BLOCK_S):
            _, sc = _slot_tile(state_row, kv_row, score_row, ape_row, pos, start, s0, offs_s,
                               even, reach, stride_sr, stride_s2, RATIO, D, OVERLAP)  # fmt: skip
            max_e = tl.maximum(max_e, tl.max(sc, axis=0))
            _, sc = _slot_tile(state_row, kv_row, score_row, ape_row, pos, start, s0, offs_s,
                               odd, reach, stride_sr, stride_s2, RATIO, D, OVERLAP)  # fmt: skip
            max_o = tl.maximum(max_o, tl.max(sc, axis=0))
        sum_e = tl.zeros((HALF,), tl.float32)
        sum_o = tl.zeros((HALF,), tl.float32)
        acc_e = tl.zeros((HALF,), tl.float32)
        acc_o = tl.zeros((HALF,), tl.float32)
        for s0 in range(0, S, BLOCK_S):
            slot_kv, sc = _slot_tile(state_row, kv_row, score_row, ape_row, pos, start, s0, offs_s,
                                even, reach, stride_sr, stride_s2, RATIO, D, OVERLAP)  # fmt: skip
            p = tl.exp(sc - max_e[None, :])
            sum_e += tl.sum(p, axis=0)
            acc_e += tl.sum(slot_kv * p, axis=0)
            slot_kv, sc = _slot_tile(state_row, kv_row, score_row, ape_row, pos, start, s0, offs_s,
                                odd, reach, stride_sr, stride_s2, RATIO, D, OVERLAP)  # fmt: skip
            p = tl.exp(sc - max_o[None, :])
            sum_o += tl.sum(p, axis=0)
            acc_o += tl.sum(slot_kv * p, axis=0)
        a = acc_e / sum_e
        c = acc_o / sum_o
        # RMSNorm over the d channels, times the norm weight
        inv_rms = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(c * c, axis=0)) / D + eps)
        a = tl.load(norm_ptr + even) * (a * inv_rms)
        c = tl.load(norm_ptr + odd) * (c * inv_rms)
        # rope on the last ROPE_HALF pairs at the entry's position w * m
        k = tl.arange(0, HALF) - (HALF - ROPE_HALF)
        rotated = k >= 0
        freq = tl.load(inv_freq_ptr + k, mask=rotated, other=0.0)
        cos, sin = _cos_sin(start.to(tl.float32) * freq, ACCURATE_TRIG)
        a, c = tl.where(rotated, a * cos - c * sin, a), tl.where(rotated, c * cos + a * sin, c)
        # entry w lies in block tables[b, w * m // BS] at row (w * m % BS) // m
        page = tl.load(block_tables_ptr + b * stride_bt + start // BS).to(tl.int64)
        entry = cache_ptr + page * stride_cblk + ((start % BS) // RATIO) * stride_centry
        tl.store(entry + even, a.to(cache_ptr.dtype.element_ty))
        tl.store(entry + odd, c.to(cache_ptr.dtype.element_ty))


@triton.jit
def v4_indexer_scores_kernel(
    # pointers
    q_ptr,  # [B, Hi, D] roped
    weights_ptr,  # [B, Hi]
    keys_ptr,  # [num_blocks, BS // RATIO, D]
    positions_ptr,  # [B]
    block_tables_ptr,  # [B, max_blocks] int32
    scores_ptr,  # [B, n] float32
    # sizes
    heads,
    n,
    scale,  # Hi^-0.5 * D^-0.5
    # strides
    stride_qb,
    stride_qh,
    stride_wb,
    stride_kblk,
    stride_kentry,
    stride_bt,
    stride_sb,
    # meta-parameters
    D: tl.constexpr,
    RATIO: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """scores[b, s] = sum_h w_h ReLU(q_h . k_s) Hi^-0.5 D^-0.5 for the row's committed
    entries s < (pos + 1) // m, -inf past them. A tile past every committed entry reads
    nothing."""
    b = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    committed = (tl.load(positions_ptr + b).to(tl.int64) + 1) // RATIO
    out = scores_ptr + b * stride_sb + offs_n
    if tl.program_id(1) * BLOCK_N >= committed:
        tl.store(out, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=offs_n < n)
    else:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, D)
        mask_h = offs_h < heads
        q = tl.load(q_ptr + b * stride_qb + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None], other=0.0)  # fmt: skip
        w = tl.load(weights_ptr + b * stride_wb + offs_h, mask=mask_h, other=0.0).to(tl.float32)
        live = offs_n < committed
        token = offs_n * RATIO
        page = tl.load(block_tables_ptr + b * stride_bt + token // BS, mask=live, other=0)
        rows = page.to(tl.int64) * stride_kblk + ((token % BS) // RATIO) * stride_kentry
        # zeros where no entry is: a stale NaN must not reach the sum through 0 * NaN
        k = tl.load(keys_ptr + rows[:, None] + offs_d[None, :], mask=live[:, None], other=0.0)
        if IEEE:
            dots = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            dots = tl.dot(q.to(k.dtype), tl.trans(k))  # [BLOCK_H, BLOCK_N] float32
        s = tl.sum(tl.maximum(dots, 0.0) * w[:, None], axis=0) * scale
        tl.store(out, tl.where(live, s, float("-inf")), mask=offs_n < n)
