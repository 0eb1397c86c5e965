"""Triton bodies for fused_moe.py's int8 path: MXFP4 experts at a few tokens per expert,
without tensor cores.

Why: at 1-8 tokens the MMA kernels (_fused_moe_kernels) spend ~8.4 instructions per
MXFP4 weight, where the H200's HBM delivers one every ~4 issue slots per SM: they are
issue-bound at 18-30% of copy. Here each 32-bit word of codes (8 nibbles) becomes two
words of int8 x 4 through a 16-entry byte-permute table (E2M1 x 2 is an exact integer:
0, +-1, 2, 3, 4, 6, 8, 12), and dp4a multiplies them by the activations quantized to int8
per 32 (the MXFP4 block): 2.6-3.4 instructions per weight in the sm_90 PTX of these K
loops (scripts/sm90_int8_mxfp4_study.py). Each block's int32 sum is scaled once by
2^(e - 127) (the weight's E8M0) x the activation's scale / 2 (the table's x 2).

Tiles: a program owns one (token, expert) pair (moe_align with BLOCK_M = 1) and BLOCK_N
output rows (gate+up: BLOCK_N units' gate and up rows), and walks K in BLOCK_K steps; the
partial sums stay per (row, 32-block) until the loop ends. One pair per program keeps
every tensor 2-D in the codes' own layout: a tile of several pairs (3-D, [rows, pairs,
words]) compiled to layout conversions through shared memory and shuffles in the K loop,
4.5-6.9 instructions per weight at 2-4 pairs. An expert that two
tokens chose is then read twice, the second time mostly from the L2: this path is for
1-4 tokens, where that is rare. The activations come quantized: x by
act_quant_int8_kernel (one small launch), h by the gate+up kernel's epilogue, which holds
whole 32-unit blocks. Quantizing inside the K loops instead cost ~1 instruction per weight
more (amax reductions across threads, sm_90 PTX).

ASM=False (the interpreter, and a GPU cross-check) runs the same decode and dp4a as plain
integer arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl

INT8_QUANT_BLOCK = 256  # columns of x per program of the activation quantization

# The table: E2M1 magnitudes x 2 by a nibble's low 3 bits, as int8 bytes of two words, and
# their negatives; see scripts/sm90_int8_mxfp4_study.py for the check of every nibble.
_DECODE_ASM = tl.constexpr("""{
.reg .b32 m, s, p, n, mh, sh;
and.b32 m, $2, 0x77777777;
shr.u32 s, $2, 1;
and.b32 s, s, 0x44444444;
or.b32 s, s, 0x32103210;
prmt.b32 p, 0x3020100, 0xc080604, m;
prmt.b32 n, 0xfdfeff00, 0xf4f8fafc, m;
prmt.b32 $0, p, n, s;
shr.u32 mh, m, 16;
shr.u32 sh, s, 16;
prmt.b32 p, 0x3020100, 0xc080604, mh;
prmt.b32 n, 0xfdfeff00, 0xf4f8fafc, mh;
prmt.b32 $1, p, n, sh;
}""")


@triton.jit
def _nibble_int8(q, j: tl.constexpr):
    """Element j (0..7) of code word q as E2M1 x 2, an int32 in -12..12."""
    n = (q >> (4 * j)) & 0xF
    e = (n >> 1) & 3
    m = n & 1
    mag = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    return tl.where((n & 8) != 0, -mag, mag)


@triton.jit
def _pack4(v0, v1, v2, v3):
    """Four int32s in -128..127 as the bytes of one int32 (v0 lowest)."""
    return (v0 & 0xFF) | ((v1 & 0xFF) << 8) | ((v2 & 0xFF) << 16) | ((v3 & 0xFF) << 24)


@triton.jit
def decode_e2m1_int8(q, ASM: tl.constexpr):
    """Code words q (int32, 8 nibbles, element 0 lowest) -> (lo, hi): int8 x 4 words of
    elements 0..3 and 4..7, each E2M1 x 2."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(_DECODE_ASM, "=r,=r,r", [q], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)  # fmt: skip
    else:
        lo = _pack4(_nibble_int8(q, 0), _nibble_int8(q, 1), _nibble_int8(q, 2), _nibble_int8(q, 3))
        hi = _pack4(_nibble_int8(q, 4), _nibble_int8(q, 5), _nibble_int8(q, 6), _nibble_int8(q, 7))
    return lo, hi


@triton.jit
def _sbyte(v, i: tl.constexpr):
    """Byte i of v, sign-extended (arithmetic shift of a signed int32)."""
    return (v << (24 - 8 * i)) >> 24


@triton.jit
def dp4a(a, b, c, ASM: tl.constexpr):
    """c + the dot of a's and b's four signed bytes (PTX dp4a.s32.s32)."""
    if ASM:
        out = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                        dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    else:
        out = c + _sbyte(a, 0) * _sbyte(b, 0) + _sbyte(a, 1) * _sbyte(b, 1)
        out += _sbyte(a, 2) * _sbyte(b, 2) + _sbyte(a, 3) * _sbyte(b, 3)
    return out


@triton.jit
def quantize_int8_words(x, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] float -> (words, scale): int8 x 4 words [BLOCK_M, BLOCK_K/4]
    (element 4j + i in byte i of word j), and the float32 scale [BLOCK_M, BLOCK_K/32] of
    each 32-block, halved to undo the decode table's x 2. Round to nearest (ties away from
    zero) in steps of amax / 127. The division is IEEE (div_rn: the plain `/` is ~2 ulp on
    a GPU, and codes near a tie would differ from the CPU's), and a NaN (or inf) in a
    block makes its scale NaN, so it reaches the output as on the MMA path."""
    xb = tl.reshape(x.to(tl.float32), [BLOCK_M, BLOCK_K // 32, 32])
    poison = tl.sum(xb * 0.0, axis=2)  # NaN where a block holds a NaN or an inf
    amax = tl.max(tl.abs(xb), axis=2)  # (a GPU's max and maximum drop NaNs)
    step = tl.math.div_rn(tl.maximum(amax, 1e-30), 127.0) + poison
    q = tl.math.div_rn(xb, step[:, :, None])
    q = tl.where(q >= 0, q + 0.5, q - 0.5).to(tl.int32)  # truncation after +-0.5
    q = tl.minimum(tl.maximum(q, -127), 127)
    # bytes i = 2 * i1 + i0 of each word: split i0 first, then i1
    even, odd = tl.split(tl.reshape(q, [BLOCK_M, BLOCK_K // 4, 2, 2]))
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    return _pack4(b0, b1, b2, b3), step * 0.5


@triton.jit
def act_quant_int8_kernel(
    x_ptr,  # [M, K] float
    q_ptr,  # [M, K/4] int32 out: int8 x 4
    s_ptr,  # [M, K/32] float32 out: each 32-block's step / 2
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    BLOCK_K: tl.constexpr,
):
    """One program per (row, BLOCK_K columns): the activations of the int8 kernels."""
    quantize_row_block(x_ptr, q_ptr, s_ptr, tl.program_id(0), tl.program_id(1), K,
                       stride_xm, stride_qm, stride_sm, BLOCK_K)  # fmt: skip


@triton.jit
def quantize_row_block(x_ptr, q_ptr, s_ptr, row, kb, K, stride_xm, stride_qm, stride_sm,
                       BLOCK_K: tl.constexpr):  # fmt: skip
    """Columns [kb * BLOCK_K, (kb + 1) * BLOCK_K) of one row, as act_quant_int8_kernel."""
    row = row.to(tl.int64)
    k0 = kb * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + row * stride_xm + offs_k[None, :], mask=offs_k[None, :] < K, other=0.0)
    words, scale = quantize_int8_words(x, 1, BLOCK_K)
    offs_q = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    tl.store(q_ptr + row * stride_qm + offs_q[None, :], words, mask=offs_q[None, :] < K // 4)
    offs_s = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    tl.store(s_ptr + row * stride_sm + offs_s[None, :], scale, mask=offs_s[None, :] < K // 32)


@triton.jit
def _e8m0(e):
    """2^(e - 127) for E8M0 bytes e in 1..254; byte 0 (2^-127) reads as 0, which no sum of
    int8 products can tell apart (the engine refuses scales above 2^1 at load anyway)."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_weights(w_rows, ws_rows, mask_n, k0, K_WORDS, BLOCK_K: tl.constexpr):
    """One K step's code words [BLOCK_N, BLOCK_K/8] of rows w_rows (word pointers
    [BLOCK_N, 1]) and their E8M0 scales [BLOCK_N, BLOCK_K/32]; past K (or masked) codes read
    as zero. K_WORDS (K / 8) is an argument of its own so that Triton's launcher sees it
    divisible by 16 where it is: the mask is then constant over 4 words and the codes load
    as 16-byte vectors (K / 8 from a K known only as divisible by 16 gives 8-byte loads)."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    offs_b = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    in_w, in_b = offs_w < K_WORDS, offs_b < K_WORDS // 4
    codes = tl.load(w_rows + offs_w[None, :], mask=mask_n[:, None] & in_w[None, :], other=0)
    ws = tl.load(ws_rows + offs_b[None, :], mask=mask_n[:, None] & in_b[None, :], other=127)
    return codes, ws


@triton.jit
def _load_acts(xq_row, xs_row, k0, K_WORDS, BLOCK_K: tl.constexpr):
    """One K step's quantized activations of a pair: the int8 x 4 words holding code word
    w's low and high halves (words 2w and 2w + 1), and the 32-blocks' scales."""
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    offs_b = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    in_w, in_b = offs_w < K_WORDS, offs_b < K_WORDS // 4
    x_lo = tl.load(xq_row + 2 * offs_w, mask=in_w, other=0)
    x_hi = tl.load(xq_row + 2 * offs_w + 1, mask=in_w, other=0)
    xs = tl.load(xs_row + offs_b, mask=in_b, other=0.0)
    return x_lo, x_hi, xs


@triton.jit
def _dot_step(acc, codes, ws, x_lo, x_hi, xs, BLOCK_K: tl.constexpr, ASM: tl.constexpr):
    """acc [BLOCK_N, BLOCK_K/32] += one K step's products, per row and 32-block: the int32
    dot of the decoded codes and the activations, times both scales."""
    w_lo, w_hi = decode_e2m1_int8(codes, ASM)
    d = dp4a(w_lo, x_lo[None, :] + tl.zeros_like(w_lo), tl.zeros_like(w_lo), ASM)
    d = dp4a(w_hi, x_hi[None, :] + tl.zeros_like(w_hi), d, ASM)
    dots = tl.sum(tl.reshape(d, [codes.shape[0], BLOCK_K // 32, 4]), axis=2)
    return acc + dots.to(tl.float32) * _e8m0(ws) * xs[None, :]


@triton.jit
def _tile_pair(sorted_pairs_ptr, block_expert_ptr, num_pairs):
    """(expert, pair) of this program's tile: moe_align with BLOCK_M = 1 gives one pair
    per tile and no padding pairs, but keep the check should its padding change; -1 for
    an unused tile."""
    pid = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid)
    pair = tl.load(sorted_pairs_ptr + pid)
    return tl.where(pair < num_pairs, expert, -1), pair.to(tl.int64)


@triton.jit
def moe_gate_up_int8_kernel(
    # pointers
    xq_ptr,  # [T, D/4] int32: the activations as int8 x 4 (act_quant_int8_kernel)
    xs_ptr,  # [T, D/32] float32: their scales
    w_ptr,  # [E, 2I, D/8] int32: the MXFP4 codes, 8 nibbles per word
    ws_ptr,  # [E, 2I, D/32] uint8 E8M0
    hq_ptr,  # [P, I/4] int32 out: silu(gate) * up per pair, quantized for the down kernel
    hs_ptr,  # [P, I/32] float32 out: its scales
    sorted_pairs_ptr,  # [max_blocks] int32 (moe_align, BLOCK_M = 1)
    block_expert_ptr,  # [max_blocks] int32, -1: unused tile
    # sizes
    num_pairs,
    D,
    I,
    K_WORDS,  # D / 8: code words per row (see _load_weights)
    # strides (in elements of each tensor)
    stride_xq,
    stride_xs,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_hq,
    stride_hs,
    # meta-parameters
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # units per program (their gate and their up rows), 32 | BLOCK_N
    BLOCK_K: tl.constexpr,  # weights per K step, a multiple of 32
    ASM: tl.constexpr,
    PREFETCH: tl.constexpr = True,  # step k + 1's loads issued before step k's math
    SWIGLU_LIMIT: tl.constexpr = None,  # the activation's clamp (as the MMA kernels' swiglu)
):
    expert, pair = _tile_pair(sorted_pairs_ptr, block_expert_ptr, num_pairs)
    if expert < 0:
        return
    token = pair // TOPK
    xq_row, xs_row = xq_ptr + token * stride_xq, xs_ptr + token * stride_xs
    units = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = units < I
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    gate_w, up_w = w_e + units[:, None] * stride_wn, w_e + (units + I)[:, None] * stride_wn
    gate_s, up_s = ws_e + units[:, None] * stride_wsn, ws_e + (units + I)[:, None] * stride_wsn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K // 32], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K // 32], tl.float32)
    if PREFETCH:
        # Every load of step k + 1 (gate and up codes, their scales, the activations) is
        # issued before step k's math: one DRAM round trip in flight behind the math, where
        # loading each tile just before its use makes ~2 dependent round trips per step (the
        # math's layout conversions put barriers between the gate's tile and the up's; sm_90
        # PTX). The last step reloads its own tiles (L1 hits): the masks stay vector-wide.
        k_last = (D - 1) // BLOCK_K * BLOCK_K
        g_next, gs_next = _load_weights(gate_w, gate_s, mask_n, 0, K_WORDS, BLOCK_K)
        u_next, us_next = _load_weights(up_w, up_s, mask_n, 0, K_WORDS, BLOCK_K)
        lo_next, hi_next, xs_next = _load_acts(xq_row, xs_row, 0, K_WORDS, BLOCK_K)
        for k0 in range(0, D, BLOCK_K):
            g, gs, u, us = g_next, gs_next, u_next, us_next
            x_lo, x_hi, x_s = lo_next, hi_next, xs_next
            k1 = tl.minimum(k0 + BLOCK_K, k_last)
            g_next, gs_next = _load_weights(gate_w, gate_s, mask_n, k1, K_WORDS, BLOCK_K)
            u_next, us_next = _load_weights(up_w, up_s, mask_n, k1, K_WORDS, BLOCK_K)
            lo_next, hi_next, xs_next = _load_acts(xq_row, xs_row, k1, K_WORDS, BLOCK_K)
            acc_g = _dot_step(acc_g, g, gs, x_lo, x_hi, x_s, BLOCK_K, ASM)
            acc_u = _dot_step(acc_u, u, us, x_lo, x_hi, x_s, BLOCK_K, ASM)
    else:
        # Each tile loaded just before its math: fewer registers (64 against 97 at the
        # one-token tile, sm_90). Slower alone, but beside the shared expert's kernels this
        # order makes the faster batch-1 decode step on the H200, whose one-token entry
        # sets PREFETCH off (docs/notes-gpu-engine.md).
        for k0 in range(0, D, BLOCK_K):
            x_lo, x_hi, x_s = _load_acts(xq_row, xs_row, k0, K_WORDS, BLOCK_K)
            g, gs = _load_weights(gate_w, gate_s, mask_n, k0, K_WORDS, BLOCK_K)
            acc_g = _dot_step(acc_g, g, gs, x_lo, x_hi, x_s, BLOCK_K, ASM)
            u, us = _load_weights(up_w, up_s, mask_n, k0, K_WORDS, BLOCK_K)
            acc_u = _dot_step(acc_u, u, us, x_lo, x_hi, x_s, BLOCK_K, ASM)
    gate = tl.sum(acc_g, axis=1)  # [BLOCK_N]
    up = tl.sum(acc_u, axis=1)  # [BLOCK_N]
    if SWIGLU_LIMIT is not None:
        gate = tl.minimum(gate, SWIGLU_LIMIT)
        up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
    h = gate * tl.sigmoid(gate) * up
    # Quantized here for the down kernel: this program holds whole 32-unit blocks.
    words, scale = quantize_int8_words(h[None, :], 1, BLOCK_N)
    offs_q = tl.program_id(1) * (BLOCK_N // 4) + tl.arange(0, BLOCK_N // 4)
    tl.store(hq_ptr + pair * stride_hq + offs_q[None, :], words, mask=offs_q[None, :] < I // 4)
    offs_s = tl.program_id(1) * (BLOCK_N // 32) + tl.arange(0, BLOCK_N // 32)
    tl.store(hs_ptr + pair * stride_hs + offs_s[None, :], scale, mask=offs_s[None, :] < I // 32)


@triton.jit
def moe_down_int8_kernel(
    # pointers
    hq_ptr,  # [P, I/4] int32 (moe_gate_up_int8_kernel)
    hs_ptr,  # [P, I/32] float32
    w_ptr,  # [E, D, I/8] int32 codes
    ws_ptr,  # [E, D, I/32] uint8 E8M0
    topk_weights_ptr,  # [P] float32 routing weights
    y_ptr,  # [T, D] float32 accumulator (zeroed by moe_align)
    sorted_pairs_ptr,
    block_expert_ptr,
    # sizes
    num_pairs,
    D,
    I,
    K_WORDS,  # I / 8: code words per row (see _load_weights)
    # strides
    stride_hq,
    stride_hs,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_yt,
    # meta-parameters
    TOPK: tl.constexpr,
    BLOCK_N: tl.constexpr,  # output rows (of D) per program
    BLOCK_K: tl.constexpr,
    ASM: tl.constexpr,
    PREFETCH: tl.constexpr = True,  # as in moe_gate_up_int8_kernel
):
    expert, pair = _tile_pair(sorted_pairs_ptr, block_expert_ptr, num_pairs)
    if expert < 0:
        return
    hq_row, hs_row = hq_ptr + pair * stride_hq, hs_ptr + pair * stride_hs
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rows < D
    w_rows = w_ptr + expert.to(tl.int64) * stride_we + rows[:, None] * stride_wn
    ws_rows = ws_ptr + expert.to(tl.int64) * stride_wse + rows[:, None] * stride_wsn
    acc = tl.zeros([BLOCK_N, BLOCK_K // 32], tl.float32)
    if PREFETCH:  # as in the gate+up kernel: step k + 1's loads before step k's math
        k_last = (I - 1) // BLOCK_K * BLOCK_K
        w_next, ws_next = _load_weights(w_rows, ws_rows, mask_n, 0, K_WORDS, BLOCK_K)
        lo_next, hi_next, hs_next = _load_acts(hq_row, hs_row, 0, K_WORDS, BLOCK_K)
        for k0 in range(0, I, BLOCK_K):
            w, ws, h_lo, h_hi, h_s = w_next, ws_next, lo_next, hi_next, hs_next
            k1 = tl.minimum(k0 + BLOCK_K, k_last)
            w_next, ws_next = _load_weights(w_rows, ws_rows, mask_n, k1, K_WORDS, BLOCK_K)
            lo_next, hi_next, hs_next = _load_acts(hq_row, hs_row, k1, K_WORDS, BLOCK_K)
            acc = _dot_step(acc, w, ws, h_lo, h_hi, h_s, BLOCK_K, ASM)
    else:
        for k0 in range(0, I, BLOCK_K):
            w, ws = _load_weights(w_rows, ws_rows, mask_n, k0, K_WORDS, BLOCK_K)
            h_lo, h_hi, h_s = _load_acts(hq_row, hs_row, k0, K_WORDS, BLOCK_K)
            acc = _dot_step(acc, w, ws, h_lo, h_hi, h_s, BLOCK_K, ASM)
    out = tl.sum(acc, axis=1) * tl.load(topk_weights_ptr + pair)
    # The combine, as in moe_down_kernel: other experts' tiles add to the same token's
    # row, hence atomics.
    y = y_ptr + (pair // TOPK) * stride_yt + rows
    tl.atomic_add(y, out, mask=mask_n, sem="relaxed")
