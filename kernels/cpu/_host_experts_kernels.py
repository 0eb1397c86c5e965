"""numba kernels behind kernels/cpu/host_experts.py. Layouts and the order of every float
sum are described there; this file holds the loops.

Every function is compiled for one explicit signature (cache=True: a process loads it from
numba's cache after the first compile). Parallel loops run over work items of one
(expert, block of output rows) each, so the thread count and the split change no bits: each
output element is computed by one thread, in an order fixed by the layout alone.

Legend: S = host slots, T = tokens, P = (token, expert) pairs on the host, D = hidden,
I = intermediate, R = rows per row block (ROWS), B = 32-value blocks of the input.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import binding as llvm
from numba import float32, int8, int32, int64, prange, uint8, void

from kernels.cpu._vnni_block_dot import MAX_TOKENS, WEIGHT_OFFSET, block_dot

ROWS = 4  # R: rows per row block; R x 16 bytes = one 64-byte line per 32-value block
GROUP = 32  # values per E8M0 scale and per int8 activation scale
HALF = GROUP // 2  # bytes per row per block
# Row blocks per parallel work item: 16 x 4 rows of a 4096-wide gate/up pair is 256 KiB of
# weights, small enough to split one expert's rows over 16 threads at decode shapes.
CHUNK_BLOCKS = 16
# Pairs whose activations one pass over a decoded weight block serves.
PAIR_TILE = 8
FP8_BLOCK = 128
LANES = 16  # float lanes of the FP8 dot (one AVX-512 vector of float32)
LANES_PER_ROW = 4  # int32 lanes of one row's 16 bytes in a 64-byte VNNI line

# The VNNI inner loop needs AVX-512 BW (vpshufb on 64 bytes) and VNNI (vpdpbusd).
_FEATURES = llvm.get_host_cpu_features()
VNNI = bool(_FEATURES.get("avx512bw") and _FEATURES.get("avx512vnni"))

_JIT = {"nogil": True, "cache": True, "boundscheck": False}


def _e2m1_times_two() -> np.ndarray:
    """code -> 2 x E2M1 value, an exact int8 (bit 3 is the sign)."""
    magnitudes = [0, 1, 2, 3, 4, 6, 8, 12]
    return np.array(magnitudes + [-m for m in magnitudes], dtype=np.int8)


def _e8m0_values() -> np.ndarray:
    """code -> 2^(code - 127) as float32, exactly (code 0 is the subnormal 2^-127)."""
    codes = np.arange(256, dtype=np.int64)
    bits = np.where(codes > 0, codes << 23, 1 << 22).astype(np.uint32)
    return bits.view(np.float32)


def _fp8_values() -> np.ndarray:
    """E4M3 byte -> float32 value, exactly (the fn variant: S.1111.111 is NaN)."""
    codes = np.arange(256, dtype=np.int64)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent = (codes >> 3) & 0xF
    mantissa = codes & 0x7
    normal = (1.0 + mantissa / 8.0) * np.exp2(exponent - 7.0)
    subnormal = mantissa / 8.0 * 2.0**-6
    values = sign * np.where(exponent > 0, normal, subnormal)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E2M1_X2 = _e2m1_times_two()
E8M0_VALUES = _e8m0_values()
FP8_VALUES = _fp8_values()


@numba.njit(float32(float32, float32, float32), inline="always", **_JIT)
def _swiglu(gate, up, limit):
    """silu(min(gate, limit)) * clamp(up, -limit, limit); limit = inf means no clamp."""
    g = min(gate, limit)
    u = max(min(up, limit), -limit)
    return g / (float32(1.0) + math.exp(-g)) * u


@numba.njit(
    void(float32[:, ::1], int8[:, ::1], float32[:, ::1], int32[:, ::1]), parallel=True, **_JIT
)
def quantize_rows(x, q, half_step, lane_bias):
    """Per row per 32 values: step = max(amax, 1e-30) / 127, q = x / step rounded to nearest
    (ties away from zero), clamped to +-127; half_step = step / 2 (undoes the x 2 of the
    E2M1 decode); lane_bias[row, 4 b + l] = -WEIGHT_OFFSET x the sum of block b's codes
    4l..4l+3 and 16+4l..16+4l+3 (takes off what the VNNI kernel's unsigned weights add).
    x [N, C], q [N, C], half_step [N, C/32], lane_bias [N, C/8]."""
    n, c = x.shape
    for row in prange(n):
        for b in range(c // GROUP):
            amax = float32(0.0)
            for j in range(GROUP):
                amax = max(amax, abs(x[row, b * GROUP + j]))
            step = max(amax, float32(1e-30)) / float32(127.0)
            for j in range(GROUP):
                v = x[row, b * GROUP + j] / step
                v = math.trunc(v + float32(0.5)) if v >= 0 else math.trunc(v - float32(0.5))
                q[row, b * GROUP + j] = int8(max(min(v, float32(127.0)), float32(-127.0)))
            half_step[row, b] = step * float32(0.5)
            for lane in range(LANES_PER_ROW):
                total = 0
                for j in range(4 * lane, 4 * lane + 4):
                    total += int32(q[row, b * GROUP + j]) + int32(q[row, b * GROUP + HALF + j])
                lane_bias[row, b * LANES_PER_ROW + lane] = -WEIGHT_OFFSET * total


MXFP4_ROWS_SIGNATURE = void(
    uint8[:, :, :, :, ::1],  # weights [S, N/R, B, rows, 16]
    uint8[:, :, :, ::1],  # scales [S, N/R, B, rows]
    int8[:, ::1],  # activations [A, B * 32] (A = tokens or pairs)
    float32[:, ::1],  # activation half steps [A, B]
    int32[:, ::1],  # activation lane bias [A, 4 B] (VNNI only)
    int32[::1],  # active slots [E_active]
    int32[::1],  # pair offsets per active slot [E_active + 1]
    int32[::1],  # activation row of each pair [P]
    float32,  # swiglu limit (gate/up only; inf: none)
    float32[:, ::1],  # out [P, N / (2 if gate/up else 1)]
)


@numba.njit(float32(float32[:, ::1], int64, int64), inline="always", **_JIT)
def _fold_lanes(acc, i, first):
    """A row's result from its 4 lane accumulators: (l0 + l1) + (l2 + l3)."""
    return (acc[i, first] + acc[i, first + 1]) + (acc[i, first + 2] + acc[i, first + 3])


@numba.njit(
    void(float32[:, ::1], int64, float32[:, ::1], int64, int64, numba.boolean, float32),
    inline="always",
    **_JIT,
)
def _store_rows(acc, i, out, p, rb, fused, limit):
    """out[p, row block rb] from accumulator row i: the R rows' dots, or with fused
    gate/up swiglu(gate row r, up row r)."""
    for r in range(ROWS):
        first = _fold_lanes(acc, i, r * LANES_PER_ROW)
        if fused:
            up = _fold_lanes(acc, i, (ROWS + r) * LANES_PER_ROW)
            out[p, rb * ROWS + r] = _swiglu(first, up, limit)
        else:
            out[p, rb * ROWS + r] = first


@numba.njit(MXFP4_ROWS_SIGNATURE, parallel=True, **_JIT)
def mxfp4_rows(w, scales, act, act_step, lane_bias, slots, offsets, act_row, limit, out):
    """out[p, n] for every pair p of every active slot, portable loops. Each row's 32-value
    block splits in 4 lanes (lane l: elements 4l..4l+3 and 16+4l..16+4l+3); a lane's int8
    dot is exact (int32), acc[lane] += float32(dot) * (half_step_b * 2^(e_b - 127)) over
    the blocks in order, and the row is (l0 + l1) + (l2 + l3): the VNNI kernel's order, so
    both give the same bits. With 2R rows per block (gate/up interleaved) the rows are R
    gate rows then R up rows and out holds swiglu(gate, up); with R rows, the dot."""
    row_blocks, blocks, rows = w.shape[1], w.shape[2], w.shape[3]
    lut = E2M1_X2
    e8m0 = E8M0_VALUES
    chunks = (row_blocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS
    for item in prange(slots.shape[0] * chunks):
        a, c = item // chunks, item % chunks
        s = slots[a]
        decoded = np.empty((rows, GROUP), dtype=np.int32)
        wscale = np.empty(rows, dtype=np.float32)
        acc = np.empty((PAIR_TILE, rows * LANES_PER_ROW), dtype=np.float32)
        for rb in range(c * CHUNK_BLOCKS, min(row_blocks, (c + 1) * CHUNK_BLOCKS)):
            for p0 in range(offsets[a], offsets[a + 1], PAIR_TILE):
                p1 = min(offsets[a + 1], p0 + PAIR_TILE)
                acc[:] = 0.0
                for b in range(blocks):
                    for r in range(rows):
                        wscale[r] = e8m0[scales[s, rb, b, r]]
                        for j in range(HALF):
                            byte = w[s, rb, b, r, j]
                            decoded[r, j] = lut[byte & 15]
                            decoded[r, HALF + j] = lut[byte >> 4]
                    for p in range(p0, p1):
                        t = act_row[p]
                        step = act_step[t, b]
                        for r in range(rows):
                            scale = step * wscale[r]
                            for lane in range(LANES_PER_ROW):
                                dot = 0
                                for j in range(4 * lane, 4 * lane + 4):
                                    dot += int32(act[t, b * GROUP + j]) * decoded[r, j]
                                    dot += (
                                        int32(act[t, b * GROUP + HALF + j]) * decoded[r, HALF + j]
                                    )
                                acc[p - p0, r * LANES_PER_ROW + lane] += float32(dot) * scale
                for p in range(p0, p1):
                    _store_rows(acc, p - p0, out, p, rb, rows == 2 * ROWS, limit)


def _mxfp4_rows_vnni(w, scales, act, act_step, lane_bias, slots, offsets, act_row, limit, out):
    """mxfp4_rows with the inner loop in AVX-512 VNNI (kernels/cpu/_vnni_block_dot.py), in
    the same order, so the same bits; up to MAX_TOKENS pairs share each decoded block."""
    row_blocks, blocks, rows = w.shape[1], w.shape[2], w.shape[3]
    fused = rows == 2 * ROWS
    chunks = (row_blocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS
    for item in prange(slots.shape[0] * chunks):
        a, c = item // chunks, item % chunks
        s = np.int64(slots[a])
        acc = np.empty((MAX_TOKENS, 2 * ROWS * LANES_PER_ROW), dtype=np.float32)
        end = np.int64(offsets[a + 1])
        for rb in range(c * CHUNK_BLOCKS, min(row_blocks, (c + 1) * CHUNK_BLOCKS)):
            sc_off = np.int64((s * row_blocks + rb) * blocks * rows)
            w_off = sc_off * HALF
            p = np.int64(offsets[a])
            while p < end:
                n = min(MAX_TOKENS, end - p)
                x = (act, lane_bias, act_step, act_row, p, acc)
                if fused and n == 4:
                    _DOT_2_4(w, w_off, scales, sc_off, blocks, *x)
                elif fused and n == 3:
                    _DOT_2_3(w, w_off, scales, sc_off, blocks, *x)
                elif fused and n == 2:
                    _DOT_2_2(w, w_off, scales, sc_off, blocks, *x)
                elif fused:
                    _DOT_2_1(w, w_off, scales, sc_off, blocks, *x)
                elif n == 4:
                    _DOT_1_4(w, w_off, scales, sc_off, blocks, *x)
                elif n == 3:
                    _DOT_1_3(w, w_off, scales, sc_off, blocks, *x)
                elif n == 2:
                    _DOT_1_2(w, w_off, scales, sc_off, blocks, *x)
                else:
                    _DOT_1_1(w, w_off, scales, sc_off, blocks, *x)
                for i in range(n):
                    _store_rows(acc, i, out, p + i, rb, fused, limit)
                p += n


if VNNI:
    _DOT_1_1, _DOT_1_2, _DOT_1_3, _DOT_1_4 = (block_dot(1, t) for t in range(1, 5))
    _DOT_2_1, _DOT_2_2, _DOT_2_3, _DOT_2_4 = (block_dot(2, t) for t in range(1, 5))
    mxfp4_rows_vnni = numba.njit(MXFP4_ROWS_SIGNATURE, parallel=True, **_JIT)(_mxfp4_rows_vnni)
else:
    mxfp4_rows_vnni = None


@numba.njit(
    float32(float32[::1], float32[::1], float32[::1], float32[::1]), inline="always", **_JIT
)
def _fp8_dot(x, w, scales, lanes):
    """sum over 128-blocks, in order, of scale * (block dot): each block's dot sums 16
    lanes (lane j: elements j, j + 16, ... of the block, in order) folded by halves."""
    k = x.shape[0]
    total = float32(0.0)
    for b in range((k + FP8_BLOCK - 1) // FP8_BLOCK):
        lanes[:] = 0.0
        for k0 in range(b * FP8_BLOCK, min(k, (b + 1) * FP8_BLOCK), LANES):
            for j in range(LANES):
                lanes[j] += x[k0 + j] * w[k0 + j]
        width = LANES
        while width > 1:
            width //= 2
            for j in range(width):
                lanes[j] += lanes[j + width]
        total += lanes[0] * scales[b]
    return total


@numba.njit(
    void(
        uint8[:, :, ::1],  # first weights [S, N, K] (E4M3 bytes): gate, or down
        uint8[:, :, ::1],  # second weights [S, N, K]: up (ignored unless fused)
        float32[:, :, ::1],  # first block scales [S, N/128, K/128]
        float32[:, :, ::1],  # second block scales
        float32[:, ::1],  # activations [A, K]
        int32[::1],  # active slots
        int32[::1],  # pair offsets per active slot
        int32[::1],  # activation row of each pair
        numba.boolean,  # fused: out = swiglu(first x, second x)
        float32,  # swiglu limit
        float32[:, ::1],  # out [P, N]
    ),
    parallel=True,
    **_JIT,
)
def fp8_rows(w1, w2, s1, s2, act, slots, offsets, act_row, fused, limit, out):
    """out[p, n] = (W1 act)[n] in float32, or swiglu(W1 act, W2 act) when fused; each
    weight row is decoded to float32 once per work item and serves every pair."""
    n, k = w1.shape[1], w1.shape[2]
    row_chunk = ROWS * CHUNK_BLOCKS
    chunks = (n + row_chunk - 1) // row_chunk
    fp8 = FP8_VALUES
    for item in prange(slots.shape[0] * chunks):
        a, c = item // chunks, item % chunks
        s = slots[a]
        row1 = np.empty(k, dtype=np.float32)
        row2 = np.empty(k, dtype=np.float32)
        lanes = np.empty(LANES, dtype=np.float32)
        for i in range(c * row_chunk, min(n, (c + 1) * row_chunk)):
            for kk in range(k):
                row1[kk] = fp8[w1[s, i, kk]]
            if fused:
                for kk in range(k):
                    row2[kk] = fp8[w2[s, i, kk]]
            for p in range(offsets[a], offsets[a + 1]):
                x = act[act_row[p]]
                first = _fp8_dot(x, row1, s1[s, i // FP8_BLOCK], lanes)
                if fused:
                    second = _fp8_dot(x, row2, s2[s, i // FP8_BLOCK], lanes)
                    out[p, i] = _swiglu(first, second, limit)
                else:
                    out[p, i] = first


@numba.njit(
    void(float32[:, ::1], int32[:, ::1], float32[:, ::1], float32[:, ::1]), parallel=True, **_JIT
)
def combine(y, pair_of, weights, out):
    """out[t] = sum over k (in k order) of weights[t, k] * y[pair_of[t, k]], skipping
    pair_of = -1; a token with no host pair gets zeros."""
    tokens, top_k = pair_of.shape
    for t in prange(tokens):
        for d in range(out.shape[1]):
            out[t, d] = 0.0
        for k in range(top_k):
            p = pair_of[t, k]
            if p >= 0:
                wk = weights[t, k]
                for d in range(out.shape[1]):
                    out[t, d] += wk * y[p, d]
