"""numba kernels behind kernels/cpu/host_experts.py. Layouts and the order of every float
sum are described there; this file holds the loops, the LLVM IR of the VNNI inner loop and
of the float32 decode, and the one-call drivers (`mxfp4_forward`, `fp8_forward`).

Everything a cached kernel calls lives in this one file: numba's cache is keyed on the
source file that defines the cached function, so an edit to a helper in another file would
leave a stale compiled kernel in the cache.

Every function is compiled for explicit signatures, one each except the drivers (int32 or
int64 expert ids) and the inlined `_group_pairs`, typed by them (cache=True: a process
loads them from numba's cache after the first compile). Parallel loops run over work items of one
(expert, block of output rows) each, so the thread count and the split change no bits: each
output element is computed by one thread, in an order fixed by the layout alone.

Legend: S = host slots, T = tokens, P = (token, expert) pairs on the host, D = hidden,
I = intermediate, R = rows per row block (ROWS), B = 32-value blocks of the input.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from llvmlite import binding as llvm
from llvmlite import ir
from numba import float32, int8, int32, int64, prange, types, uint8, void
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.formats.mxfp4 import E2M1_VALUES

ROWS = 4  # R: rows per row block; R x 16 bytes = one 64-byte line per 32-value block
GROUP = 32  # values per E8M0 scale and per int8 activation scale
HALF = GROUP // 2  # bytes per row per block
# Row blocks per parallel work item: 16 x 4 rows of a 4096-wide gate/up pair is 256 KiB of
# weights, small enough to split one expert's rows over 16 threads at decode shapes.
CHUNK_BLOCKS = 16
# Pairs whose activations one pass over a decoded weight block serves.
PAIR_TILE = 8
# Quantizing or combining up to this many values runs on the calling thread: waking the
# pool costs more than the work at decode sizes.
SERIAL_VALUES = 1 << 16
FP8_BLOCK = 128
LANES = 16  # float lanes of the FP8 dot (one AVX-512 vector of float32); K % 16 == 0
LANES_PER_ROW = 4  # int32 lanes of one row's 16 bytes in a 64-byte VNNI line

# The VNNI inner loop needs AVX-512 BW (vpshufb on 64 bytes) and VNNI (vpdpbusd).
_FEATURES = llvm.get_host_cpu_features()
VNNI = bool(_FEATURES.get("avx512bw") and _FEATURES.get("avx512vnni"))

_JIT = {"nogil": True, "cache": True, "boundscheck": False}


# The AVX-512 VNNI inner loop of the MXFP4 kernel (`block_dot`), numba intrinsics built
# from LLVM IR: LLVM does not turn a nibble-table lookup into vpshufb or an int8 dot into
# vpdpbusd from plain loops, so both are called by name here.
#
# One call runs one row block (`lines` x 64-byte lines per 32-value input block: 1 for down's
# 4 rows, 2 for gate/up's 4 + 4 rows) over all input blocks for `tokens` activation rows, the
# decoded weights of each block serving every token. For each block b and line:
#
# - the 64 bytes split into low and high nibbles (vpand, vpsrlw); vpshufb maps each code to
#   12 + 2 x E2M1 (0..24, unsigned), so vpdpbusd (unsigned x signed bytes) takes the weights
#   as its unsigned operand and the int8 activations as they are;
# - int32 lane 4r + q of the line (row r, q = 0..3) gets the exact dot of the row's elements
#   4q..4q+3 and 16+4q..16+4q+3 with the activations: vpdpbusd starts from `lane_bias`,
#   -12 x the sum of those activations (per token, block and q, precomputed), which takes
#   off what the weights' offset of 12 adds;
# - acc[lane] += float32(dot) * (step_b * 2^(e_rb - 127)), a multiply then an add (no FMA,
#   so `mxfp4_rows` gives the same bits lane by lane).
#
# The caller folds each row's 4 lanes as (l0 + l1) + (l2 + l3).

MAX_TOKENS = 4  # 4 tokens x 2 lines of float accumulators + decoded weights fit 32 registers
WEIGHT_OFFSET = 12  # 2 x E2M1 is in -12..12
# How far ahead of the line being decoded to prefetch the weights: one core's misses in
# flight otherwise cap its read rate below its share of the memory bandwidth.
PREFETCH_BYTES = 2048
# vpshufb table: code -> 12 + 2 x E2M1 value (bit 3 of the code is the sign)
_E2M1_MAGNITUDES_X2 = (0, 1, 2, 3, 4, 6, 8, 12)
OFFSET_TABLE = [WEIGHT_OFFSET + v for v in _E2M1_MAGNITUDES_X2] + [
    WEIGHT_OFFSET - v for v in _E2M1_MAGNITUDES_X2
]

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_V64I8 = ir.VectorType(_I8, 64)
_V16I32 = ir.VectorType(_I32, 16)
_V16F32 = ir.VectorType(_F32, 16)


def _c64(v: int):
    return ir.Constant(_I64, v)


def _mask(values):
    return ir.Constant(ir.VectorType(ir.IntType(32), len(values)), list(values))


def _ptr_load(builder, ptr, typ):
    """An unaligned load of `typ` at ptr (an element pointer)."""
    if getattr(ptr.type, "is_opaque", False):
        return builder.load(ptr, typ=typ, align=1)
    return builder.load(builder.bitcast(ptr, typ.as_pointer()), align=1)


def _gep(builder, ptr, offset):
    return builder.gep(ptr, [offset])


def _prefetch(builder, ptr):
    """A read prefetch into all cache levels (past the array's end it is a no-op)."""
    i32 = ir.IntType(32)
    if getattr(ptr.type, "is_opaque", False):
        name = "llvm.prefetch.p0"
    else:
        ptr = builder.bitcast(ptr, _I8.as_pointer())
        name = "llvm.prefetch.p0i8"
    fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
    fn = cgutils.get_or_insert_function(builder.module, fnty, name)
    builder.call(fn, [ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])


def _x86(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), args)


@functools.cache
def block_dot(lines: int, tokens: int):
    """block_dot(w, w_off, sc, sc_off, blocks, act, lane_bias, steps, act_row, p0, acc):
    the accumulators of one row block (module docstring) for the activation rows
    act_row[p0 : p0 + tokens], written to acc[i, 16 l : 16 l + 16] for token i, line l.
    w / sc: the layer's weights / scales (w_off, sc_off: element offsets of the row
    block); act int8 [A, 32 B]; lane_bias int32 [A, 4 B]; steps float32 [A, B]."""

    @intrinsic
    def dot(typingctx, w, w_off, sc, sc_off, blocks, act, lane_bias, steps, act_row, p0, acc):
        sig = types.void(w, w_off, sc, sc_off, blocks, act, lane_bias, steps, act_row, p0, acc)

        def codegen(context, builder, signature, args):
            arrays = [
                context.make_array(signature.args[i])(context, builder, args[i])
                for i in (0, 2, 5, 6, 7, 8, 10)
            ]
            wa, sa, xa, la, ta, ra, aa = arrays
            w_off, sc_off, n_blocks, p0 = args[1], args[3], args[4], args[9]
            in_width = cgutils.unpack_tuple(builder, xa.shape)[1]  # 32 B
            acc_width = cgutils.unpack_tuple(builder, aa.shape)[1]
            rows = []
            for i in range(tokens):
                idx = builder.add(p0, _c64(i))
                rows.append(builder.sext(builder.load(_gep(builder, ra.data, idx)), _I64))
            table = ir.Constant(_V64I8, OFFSET_TABLE * 4)
            low_bits = ir.Constant(_V64I8, [0x0F] * 64)
            four = ir.Constant(_V64I8, [4] * 64)

            entry = builder.block
            header = builder.append_basic_block("blocks.header")
            body = builder.append_basic_block("blocks.body")
            done = builder.append_basic_block("blocks.done")
            builder.branch(header)

            builder.position_at_end(header)
            b = builder.phi(_I64)
            b.add_incoming(_c64(0), entry)
            accs = [[builder.phi(_V16F32) for _ in range(lines)] for _ in range(tokens)]
            for row in accs:
                for a in row:
                    a.add_incoming(ir.Constant(_V16F32, [0.0] * 16), entry)
            builder.cbranch(builder.icmp_signed("<", b, n_blocks), body, done)

            builder.position_at_end(body)
            weights, scales = [], []
            for line in range(lines):
                index = builder.add(builder.mul(b, _c64(lines)), _c64(line))
                w_ptr = _gep(builder, wa.data, builder.add(w_off, builder.mul(index, _c64(64))))
                packed = _ptr_load(builder, w_ptr, _V64I8)
                if PREFETCH_BYTES:
                    _prefetch(builder, _gep(builder, w_ptr, _c64(PREFETCH_BYTES)))
                lo = builder.and_(packed, low_bits)
                hi = builder.and_(builder.lshr(packed, four), low_bits)
                pair = []
                for nib in (lo, hi):
                    dec = _x86(builder, "llvm.x86.avx512.pshuf.b.512", _V64I8, [table, nib])
                    pair.append(builder.bitcast(dec, _V16I32))
                weights.append(pair)
            # the E8M0 scales of all lines' rows at once (4 per line, contiguous)
            n_scales = 4 * lines
            s_ptr = _gep(builder, sa.data, builder.add(sc_off, builder.mul(b, _c64(n_scales))))
            e = builder.zext(
                _ptr_load(builder, s_ptr, ir.VectorType(_I8, n_scales)),
                ir.VectorType(_I32, n_scales),
            )
            zero = ir.Constant(ir.VectorType(_I32, n_scales), [0] * n_scales)
            bits = builder.select(
                builder.icmp_unsigned("==", e, zero),
                ir.Constant(ir.VectorType(_I32, n_scales), [1 << 22] * n_scales),
                builder.shl(e, ir.Constant(ir.VectorType(_I32, n_scales), [23] * n_scales)),
            )
            per_row = builder.bitcast(bits, ir.VectorType(_F32, n_scales))
            for line in range(lines):
                spread = [4 * line + r for r in range(4) for _ in range(4)]  # row r -> lanes 4r..
                scales.append(builder.shuffle_vector(per_row, per_row, _mask(spread)))
            for i in range(tokens):
                x_row = _gep(
                    builder,
                    xa.data,
                    builder.add(builder.mul(rows[i], in_width), builder.mul(b, _c64(32))),
                )
                halves = []
                for h in range(2):
                    x16 = _ptr_load(
                        builder, _gep(builder, x_row, _c64(16 * h)), ir.VectorType(_I8, 16)
                    )
                    x64 = builder.shuffle_vector(x16, x16, _mask(list(range(16)) * 4))
                    halves.append(builder.bitcast(x64, _V16I32))
                blocks_per_row = builder.sdiv(in_width, _c64(32))
                cell = builder.add(builder.mul(rows[i], blocks_per_row), b)
                bias_ptr = _gep(builder, la.data, builder.mul(cell, _c64(4)))
                bias4 = _ptr_load(builder, bias_ptr, ir.VectorType(_I32, 4))
                bias = builder.shuffle_vector(bias4, bias4, _mask(list(range(4)) * 4))
                step = builder.load(_gep(builder, ta.data, cell))
                step16 = builder.insert_element(
                    ir.Constant(_V16F32, ir.Undefined), step, ir.Constant(_I32, 0)
                )
                step16 = builder.shuffle_vector(step16, step16, _mask([0] * 16))
                for line in range(lines):
                    d = bias
                    for h in range(2):
                        d = _x86(
                            builder,
                            "llvm.x86.avx512.vpdpbusd.512",
                            _V16I32,
                            [d, weights[line][h], halves[h]],
                        )
                    f = builder.sitofp(d, _V16F32)
                    new = builder.fadd(
                        accs[i][line], builder.fmul(f, builder.fmul(step16, scales[line]))
                    )
                    accs[i][line].add_incoming(new, body)
            b.add_incoming(builder.add(b, _c64(1)), body)
            builder.branch(header)

            builder.position_at_end(done)
            for i in range(tokens):
                for line in range(lines):
                    out = _gep(
                        builder,
                        aa.data,
                        builder.add(builder.mul(_c64(i), acc_width), _c64(16 * line)),
                    )
                    if getattr(out.type, "is_opaque", False):
                        builder.store(accs[i][line], out, align=4)
                    else:
                        builder.store(
                            accs[i][line], builder.bitcast(out, _V16F32.as_pointer()), align=4
                        )
            return context.get_dummy_value()

        return sig, codegen

    return dot


@functools.cache
def float_dot(tokens: int):
    """float_dot(w, act, act_row, p0, out): out[i] = w . act[act_row[p0 + i]] for i <
    tokens, float32 (w [K], act [A, K], K % 16 == 0). The order, the same for every
    `tokens`: lane j sums w[k] * act[k] for k = j, j + 16, ... in k order (a multiply then
    an add, never fused), then the lanes fold by halves (j + 8 onto j, + 4, + 2, + 1)."""

    @intrinsic
    def dot(typingctx, w, act, act_row, p0, out):
        sig = types.void(w, act, act_row, p0, out)

        def codegen(context, builder, signature, args):
            wa, xa, ra, _, oa = (
                context.make_array(signature.args[i])(context, builder, args[i]) if i != 3 else None
                for i in range(5)
            )
            p0 = args[3]
            k = cgutils.unpack_tuple(builder, xa.shape)[1]
            x_rows = []
            for i in range(tokens):
                row = builder.load(_gep(builder, ra.data, builder.add(p0, _c64(i))))
                x_rows.append(_gep(builder, xa.data, builder.mul(builder.sext(row, _I64), k)))
            entry = builder.block
            header = builder.append_basic_block("k.header")
            body = builder.append_basic_block("k.body")
            done = builder.append_basic_block("k.done")
            builder.branch(header)
            builder.position_at_end(header)
            kk = builder.phi(_I64)
            kk.add_incoming(_c64(0), entry)
            accs = [builder.phi(_V16F32) for _ in range(tokens)]
            for a in accs:
                a.add_incoming(ir.Constant(_V16F32, [0.0] * 16), entry)
            builder.cbranch(builder.icmp_signed("<", kk, k), body, done)
            builder.position_at_end(body)
            wv = _ptr_load(builder, _gep(builder, wa.data, kk), _V16F32)
            for i in range(tokens):
                xv = _ptr_load(builder, _gep(builder, x_rows[i], kk), _V16F32)
                accs[i].add_incoming(builder.fadd(accs[i], builder.fmul(xv, wv)), body)
            kk.add_incoming(builder.add(kk, _c64(16)), body)
            builder.branch(header)
            builder.position_at_end(done)
            for i, v in enumerate(accs):
                width = 16
                while width > 1:
                    half = width // 2
                    lo = builder.shuffle_vector(v, v, _mask(range(half)))
                    hi = builder.shuffle_vector(v, v, _mask(range(half, width)))
                    v = builder.fadd(lo, hi)
                    width = half
                total = builder.extract_element(v, ir.Constant(_I32, 0))
                builder.store(total, _gep(builder, oa.data, _c64(i)))
            return context.get_dummy_value()

        return sig, codegen

    return dot


_FLOAT_DOT_1, _FLOAT_DOT_2, _FLOAT_DOT_3, _FLOAT_DOT_4 = (float_dot(t) for t in range(1, 5))


_E2M1_FLOATS = list(E2M1_VALUES)  # code -> value, the table kernels/formats decodes by


@intrinsic
def _decode_row_vector(typingctx, w, w_off, sc, sc_off, blocks, rows, row):
    """_decode_mxfp4_row's loop in AVX-512: per 32-value block, the row's 16 bytes split in
    nibbles and vpermps looks each code up in the 16 E2M1 values (one register), times the
    block's E8M0 scale. w_off / sc_off: element offsets of the row's first block; blocks
    step by rows x 16 bytes and rows scales."""
    sig = types.void(w, w_off, sc, sc_off, blocks, rows, row)

    def codegen(context, builder, signature, args):
        wa, sa, oa = (
            context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 6)
        )
        w_off, sc_off, n_blocks, rows = args[1], args[3], args[4], args[5]
        v16i8, v16i32 = ir.VectorType(_I8, 16), _V16I32
        table = ir.Constant(_V16F32, _E2M1_FLOATS)
        low_bits = ir.Constant(v16i32, [15] * 16)
        four = ir.Constant(v16i32, [4] * 16)
        entry = builder.block
        header = builder.append_basic_block("decode.header")
        body = builder.append_basic_block("decode.body")
        done = builder.append_basic_block("decode.done")
        builder.branch(header)
        builder.position_at_end(header)
        b = builder.phi(_I64)
        b.add_incoming(_c64(0), entry)
        builder.cbranch(builder.icmp_signed("<", b, n_blocks), body, done)
        builder.position_at_end(body)
        step = builder.mul(rows, _c64(HALF))
        packed = _ptr_load(
            builder, _gep(builder, wa.data, builder.add(w_off, builder.mul(b, step))), v16i8
        )
        codes = builder.zext(packed, v16i32)
        e = builder.zext(
            builder.load(_gep(builder, sa.data, builder.add(sc_off, builder.mul(b, rows)))), _I32
        )
        bits = builder.select(
            builder.icmp_unsigned("==", e, ir.Constant(_I32, 0)),
            ir.Constant(_I32, 1 << 22),
            builder.shl(e, ir.Constant(_I32, 23)),
        )
        scale = builder.bitcast(bits, _F32)
        scale16 = builder.insert_element(
            ir.Constant(_V16F32, ir.Undefined), scale, ir.Constant(_I32, 0)
        )
        scale16 = builder.shuffle_vector(scale16, scale16, _mask([0] * 16))
        for h, nib in enumerate((builder.and_(codes, low_bits), builder.lshr(codes, four))):
            values = _x86(builder, "llvm.x86.avx512.permvar.sf.512", _V16F32, [table, nib])
            out = _gep(builder, oa.data, builder.add(builder.mul(b, _c64(GROUP)), _c64(HALF * h)))
            result = builder.fmul(values, scale16)
            if getattr(out.type, "is_opaque", False):
                builder.store(result, out, align=4)
            else:
                builder.store(result, builder.bitcast(out, _V16F32.as_pointer()), align=4)
        b.add_incoming(builder.add(b, _c64(1)), body)
        builder.branch(header)
        builder.position_at_end(done)
        return context.get_dummy_value()

    return sig, codegen


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


QUANTIZE_ROW_SIGNATURE = void(float32[:, ::1], int64, int8[:, ::1], float32[:, ::1], int32[:, ::1])


@numba.njit(QUANTIZE_ROW_SIGNATURE, inline="always", **_JIT)
def _quantize_row(x, row, q, half_step, lane_bias):
    """Row `row` of quantize_rows."""
    c = x.shape[1]
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


@numba.njit(
    void(float32[:, ::1], int8[:, ::1], float32[:, ::1], int32[:, ::1]), parallel=True, **_JIT
)
def quantize_rows(x, q, half_step, lane_bias):
    """Per row per 32 values: step = max(amax, 1e-30) / 127, q = x / step rounded to nearest
    (ties away from zero), clamped to +-127; half_step = step / 2 (undoes the x 2 of the
    E2M1 decode); lane_bias[row, 4 b + l] = -WEIGHT_OFFSET x the sum of block b's codes
    4l..4l+3 and 16+4l..16+4l+3 (takes off what the VNNI kernel's unsigned weights add).
    x [N, C], q [N, C], half_step [N, C/32], lane_bias [N, C/8]."""
    for row in prange(x.shape[0]):
        _quantize_row(x, row, q, half_step, lane_bias)


@numba.njit(
    void(float32[:, ::1], int64, int8[:, ::1], float32[:, ::1], int32[:, ::1]),
    parallel=True,
    **_JIT,
)
def _quantize_first_rows_parallel(x, n, q, half_step, lane_bias):
    for row in prange(n):
        _quantize_row(x, row, q, half_step, lane_bias)


@numba.njit(QUANTIZE_ROW_SIGNATURE, **_JIT)
def quantize_first_rows(x, n, q, half_step, lane_bias):
    """quantize_rows on rows 0..n-1 of x; below SERIAL_VALUES values on the calling
    thread, since waking the pool costs more than the work (the same bits either way)."""
    if n * x.shape[1] <= SERIAL_VALUES:
        for row in range(n):
            _quantize_row(x, row, q, half_step, lane_bias)
    else:
        _quantize_first_rows_parallel(x, n, q, half_step, lane_bias)


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
    """mxfp4_rows with the inner loop in AVX-512 VNNI (`block_dot`), in
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
    void(float32[::1], float32[:, ::1], int32[::1], int64, int64, float32[::1]),
    inline="always",
    **_JIT,
)
def _float_dots(w, act, act_row, p, n, out):
    """out[:n] = w . act[act_row[p + i]] (`float_dot`, the same order for every n)."""
    if n == 4:
        _FLOAT_DOT_4(w, act, act_row, p, out)
    elif n == 3:
        _FLOAT_DOT_3(w, act, act_row, p, out)
    elif n == 2:
        _FLOAT_DOT_2(w, act, act_row, p, out)
    else:
        _FLOAT_DOT_1(w, act, act_row, p, out)


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
    """out[p, n] = (W1 act)[n] in float32, or swiglu(W1 act, W2 act) when fused. Each
    weight row is dequantized once per work item (E4M3 value x its block scale, the float32
    product kernels/formats' dequantize gives) and serves up to MAX_TOKENS pairs per
    `float_dot` call."""
    n, k = w1.shape[1], w1.shape[2]
    row_chunk = ROWS * CHUNK_BLOCKS
    chunks = (n + row_chunk - 1) // row_chunk
    fp8 = FP8_VALUES
    for item in prange(slots.shape[0] * chunks):
        a, c = item // chunks, item % chunks
        s = slots[a]
        row1 = np.empty(k, dtype=np.float32)
        row2 = np.empty(k, dtype=np.float32)
        first = np.empty(MAX_TOKENS, dtype=np.float32)
        second = np.empty(MAX_TOKENS, dtype=np.float32)
        end = np.int64(offsets[a + 1])
        for i in range(c * row_chunk, min(n, (c + 1) * row_chunk)):
            for kk in range(k):
                row1[kk] = fp8[w1[s, i, kk]] * s1[s, i // FP8_BLOCK, kk // FP8_BLOCK]
            if fused:
                for kk in range(k):
                    row2[kk] = fp8[w2[s, i, kk]] * s2[s, i // FP8_BLOCK, kk // FP8_BLOCK]
            p = np.int64(offsets[a])
            while p < end:
                m = min(MAX_TOKENS, end - p)
                _float_dots(row1, act, act_row, p, m, first)
                if fused:
                    _float_dots(row2, act, act_row, p, m, second)
                for j in range(m):
                    if fused:
                        out[p + j, i] = _swiglu(first[j], second[j], limit)
                    else:
                        out[p + j, i] = first[j]
                p += m


def _e2m1_values() -> np.ndarray:
    """code -> E2M1 value as float32 (bit 3 is the sign)."""
    magnitudes = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return np.array(magnitudes + [-m for m in magnitudes], dtype=np.float32)


E2M1_VALUES = _e2m1_values()


@numba.njit(
    void(uint8[:, :, :, :, ::1], uint8[:, :, :, ::1], int64, int64, int64, float32[::1]),
    inline="always",
    **_JIT,
)
def _decode_mxfp4_row(w, scales, s, rb, r, row):
    """Row r of row block rb of slot s as float32: E2M1 value x 2^(e - 127), exact (the
    float32 product kernels/formats' dequantize_mxfp4 gives)."""
    if VNNI:
        rows = np.int64(w.shape[3])
        sc_off = ((s * w.shape[1] + rb) * w.shape[2]) * rows + r
        _decode_row_vector(w, sc_off * HALF, scales, sc_off, np.int64(w.shape[2]), rows, row)
        return
    lut = E2M1_VALUES
    e8m0 = E8M0_VALUES
    for b in range(w.shape[2]):
        scale = e8m0[scales[s, rb, b, r]]
        for j in range(HALF):
            byte = w[s, rb, b, r, j]
            row[b * GROUP + j] = lut[byte & 15] * scale
            row[b * GROUP + HALF + j] = lut[byte >> 4] * scale


@numba.njit(
    void(
        uint8[:, :, :, :, ::1],  # weights [S, N/R, B, rows, 16]
        uint8[:, :, :, ::1],  # scales [S, N/R, B, rows]
        float32[:, ::1],  # activations [A, B * 32] float32
        int32[::1],  # active slots
        int32[::1],  # pair offsets per active slot
        int32[::1],  # activation row of each pair
        float32,  # swiglu limit (gate/up only)
        float32[:, ::1],  # out [P, N / (2 if gate/up else 1)]
    ),
    parallel=True,
    **_JIT,
)
def mxfp4_rows_f32(w, scales, act, slots, offsets, act_row, limit, out):
    """mxfp4_rows with float32 activations: each weight row is decoded exactly to float32
    once per work item and dotted by `float_dot` (lane j: elements j, j + 16, ... in
    order, lanes folded by halves) with up to MAX_TOKENS pairs per call. With 2R rows per
    block (gate/up interleaved) out holds swiglu(gate row r, up row r), else the dot."""
    row_blocks, blocks, rows = w.shape[1], w.shape[2], w.shape[3]
    fused = rows == 2 * ROWS
    k = blocks * GROUP
    chunks = (row_blocks + CHUNK_BLOCKS - 1) // CHUNK_BLOCKS
    for item in prange(slots.shape[0] * chunks):
        a, c = item // chunks, item % chunks
        s = np.int64(slots[a])
        first_row = np.empty(k, dtype=np.float32)
        second_row = np.empty(k, dtype=np.float32)
        first = np.empty(MAX_TOKENS, dtype=np.float32)
        second = np.empty(MAX_TOKENS, dtype=np.float32)
        end = np.int64(offsets[a + 1])
        for rb in range(c * CHUNK_BLOCKS, min(row_blocks, (c + 1) * CHUNK_BLOCKS)):
            for r in range(ROWS):
                _decode_mxfp4_row(w, scales, s, rb, r, first_row)
                if fused:
                    _decode_mxfp4_row(w, scales, s, rb, ROWS + r, second_row)
                p = np.int64(offsets[a])
                while p < end:
                    m = min(MAX_TOKENS, end - p)
                    _float_dots(first_row, act, act_row, p, m, first)
                    if fused:
                        _float_dots(second_row, act, act_row, p, m, second)
                    for j in range(m):
                        if fused:
                            out[p + j, rb * ROWS + r] = _swiglu(first[j], second[j], limit)
                        else:
                            out[p + j, rb * ROWS + r] = first[j]
                    p += m


# -- one call per layer: grouping, the experts and the combine ----------------------------
#
# Status codes the drivers return as (code, value); the Python wrapper raises.
DONE = 0  # value: pairs computed
BAD_ID = 1  # value: flat index t * K + k of an expert id outside -1..E-1
BAD_SLOT = 2  # value: the global id whose slot_of entry is outside -1..S-1
NEED_PAIRS = 3  # value: pairs the call has (the pair buffers are smaller): grow, call again

_SCRATCH = (
    int32[::1],  # cursor per slot [>= S]
    int32[::1],  # active slots [>= S]
    int32[::1],  # pair offsets per active slot [>= S + 1]
    int32[::1],  # token of each pair [>= P]
    int32[::1],  # identity: pair p's activation row is p [>= P]
    int32[::1],  # pair of each (t, k), flat t * K + k, or -1 [>= T * K]
)


@numba.njit(inline="always", **_JIT)
def _group_pairs(slot_of, ids, num_slots, cursor, slots, offsets, pair_token, pair_of):
    """Pairs grouped by host slot (slots ascending, tokens in order within a slot):
    fills slots[:n], offsets[:n + 1], pair_token[:P], pair_of[:T K]; returns
    (code, n, P) with code DONE, or a failure (code, value, 0)."""
    tokens, top_k = ids.shape
    num_experts = slot_of.shape[0]
    for s in range(num_slots):
        cursor[s] = 0
    for t in range(tokens):
        for k in range(top_k):
            e = np.int64(ids[t, k])
            if e == -1:
                continue
            if e < -1 or e >= num_experts:
                return BAD_ID, t * top_k + k, 0
            s = np.int64(slot_of[e])
            if s < -1 or s >= num_slots:
                return BAD_SLOT, e, 0
            if s >= 0:
                cursor[s] += 1
    active = 0
    total = 0
    offsets[0] = 0
    for s in range(num_slots):
        count = cursor[s]
        if count:
            slots[active] = s
            cursor[s] = total  # from here: the next pair position of slot s
            total += count
            active += 1
            offsets[active] = total
    if total > pair_token.shape[0]:
        return NEED_PAIRS, total, 0
    for t in range(tokens):
        for k in range(top_k):
            e = np.int64(ids[t, k])
            s = np.int64(slot_of[e]) if e >= 0 else -1
            if s < 0:
                pair_of[t * top_k + k] = -1
            else:
                p = cursor[s]
                cursor[s] = p + 1
                pair_token[p] = t
                pair_of[t * top_k + k] = p
    return DONE, active, total


@numba.njit(
    void(float32[:, ::1], int32[::1], int64, float32[:, ::1], int64, float32[:, ::1]),
    inline="always",
    **_JIT,
)
def _combine_token(y, pair_of, top_k, weights, t, out):
    """out[t] = sum over k (in k order) of weights[t, k] * y[pair_of[t K + k]], skipping
    -1; zeros when none."""
    for d in range(out.shape[1]):
        out[t, d] = 0.0
    for k in range(top_k):
        p = pair_of[t * top_k + k]
        if p >= 0:
            wk = weights[t, k]
            for d in range(out.shape[1]):
                out[t, d] += wk * y[p, d]


@numba.njit(
    void(float32[:, ::1], int32[::1], int64, float32[:, ::1], float32[:, ::1]),
    parallel=True,
    **_JIT,
)
def _combine_parallel(y, pair_of, top_k, weights, out):
    for t in prange(out.shape[0]):
        _combine_token(y, pair_of, top_k, weights, t, out)


@numba.njit(void(float32[:, ::1], int32[::1], int64, float32[:, ::1], float32[:, ::1]), **_JIT)
def combine_pairs(y, pair_of, top_k, weights, out):
    """out[t] = sum over k (in k order) of weights[t, k] * y[pair_of[t K + k]] (pair_of
    -1: skipped; a token with no host pair gets zeros); up to SERIAL_VALUES values of out
    on the calling thread, more in the pool (the same bits either way)."""
    if out.shape[0] * out.shape[1] <= SERIAL_VALUES:
        for t in range(out.shape[0]):
            _combine_token(y, pair_of, top_k, weights, t, out)
    else:
        _combine_parallel(y, pair_of, top_k, weights, out)


_MXFP4_ROWS_INT8 = mxfp4_rows_vnni if VNNI else mxfp4_rows


def _forward_signatures(experts, ids_types, extra):
    return [
        types.UniTuple(int64, 2)(
            *experts,
            int32[::1],  # slot_of [E]: global expert id -> host slot or -1
            ids[:, ::1],  # expert ids [T, K] (global; -1: none)
            float32[:, ::1],  # routing weights [T, K]
            float32[:, ::1],  # x [T, D]
            float32,  # swiglu limit (inf: none)
            float32[:, ::1],  # out [T, D]
            *_SCRATCH,
            *extra,
        )
        for ids in ids_types
    ]


_MXFP4_EXPERTS = (uint8[:, :, :, :, ::1], uint8[:, :, :, ::1]) * 2
_MXFP4_SCRATCH = (
    numba.boolean,  # float32 activations (exact) instead of int8
    int8[:, ::1],  # x codes [>= T, D]
    float32[:, ::1],  # x half steps [>= T, D/32]
    int32[:, ::1],  # x lane bias [>= T, D/8]
    float32[:, ::1],  # h: swiglu outputs [>= P, I]
    int8[:, ::1],  # h codes [>= P, I] (int8 mode)
    float32[:, ::1],  # h half steps [>= P, I/32]
    int32[:, ::1],  # h lane bias [>= P, I/8]
    float32[:, ::1],  # y: expert outputs [>= P, D]
)


@numba.njit(_forward_signatures(_MXFP4_EXPERTS, (int32, int64), _MXFP4_SCRATCH), **_JIT)
def mxfp4_forward(
    gate_up, gate_up_scales, down, down_scales, slot_of, ids, weights, x, limit, out,
    cursor, slots, offsets, pair_token, identity, pair_of,
    exact, xq, xs, xl, h, hq, hs, hl, y,
):  # fmt: skip
    """One layer's host experts: group the pairs, gate/up with SwiGLU, down, combine into
    out (written; tokens with no host pair get zeros). exact: float32 activations
    (`mxfp4_rows_f32`), else int8 (`mxfp4_rows_vnni` / `mxfp4_rows`). Returns
    (DONE, pairs) or a failure code (see above); on NEED_PAIRS nothing is written."""
    code, active, pairs = _group_pairs(
        slot_of, ids, gate_up.shape[0], cursor, slots, offsets, pair_token, pair_of
    )
    if code != DONE:
        return code, active
    if pairs:
        s, o = slots[:active], offsets[: active + 1]
        if exact:
            mxfp4_rows_f32(gate_up, gate_up_scales, x, s, o, pair_token, limit, h)
            mxfp4_rows_f32(down, down_scales, h, s, o, identity, limit, y)
        else:
            quantize_first_rows(x, x.shape[0], xq, xs, xl)
            _MXFP4_ROWS_INT8(gate_up, gate_up_scales, xq, xs, xl, s, o, pair_token, limit, h)
            quantize_first_rows(h, pairs, hq, hs, hl)
            _MXFP4_ROWS_INT8(down, down_scales, hq, hs, hl, s, o, identity, limit, y)
    combine_pairs(y, pair_of, ids.shape[1], weights, out)
    return DONE, pairs


_FP8_EXPERTS = (uint8[:, :, ::1],) * 3 + (float32[:, :, ::1],) * 3
_FP8_SCRATCH = (
    float32[:, ::1],  # h: swiglu outputs [>= P, I]
    float32[:, ::1],  # y: expert outputs [>= P, D]
)


@numba.njit(_forward_signatures(_FP8_EXPERTS, (int32, int64), _FP8_SCRATCH), **_JIT)
def fp8_forward(
    gate, up, down, gate_scales, up_scales, down_scales, slot_of, ids, weights, x, limit, out,
    cursor, slots, offsets, pair_token, identity, pair_of, h, y,
):  # fmt: skip
    """mxfp4_forward for FP8 experts (`fp8_rows`, float32 activations)."""
    code, active, pairs = _group_pairs(
        slot_of, ids, gate.shape[0], cursor, slots, offsets, pair_token, pair_of
    )
    if code != DONE:
        return code, active
    if pairs:
        s, o = slots[:active], offsets[: active + 1]
        fp8_rows(gate, up, gate_scales, up_scales, x, s, o, pair_token, True, limit, h)
        fp8_rows(down, down, down_scales, down_scales, h, s, o, identity, False, limit, y)
    combine_pairs(y, pair_of, ids.shape[1], weights, out)
    return DONE, pairs
