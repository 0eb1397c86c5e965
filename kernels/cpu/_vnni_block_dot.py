"""The AVX-512 VNNI inner loop of the MXFP4 host expert kernel, as numba intrinsics built
from LLVM IR: LLVM does not turn a nibble-table lookup into vpshufb or an int8 dot into
vpdpbusd from plain loops, so both are called by name here.

One call runs one row block (`lines` x 64-byte lines per 32-value input block: 1 for down's
4 rows, 2 for gate/up's 4 + 4 rows) over all input blocks for `tokens` activation rows, the
decoded weights of each block serving every token. For each block b and line:

- the 64 bytes split into low and high nibbles (vpand, vpsrlw); vpshufb maps each code to
  12 + 2 x E2M1 (0..24, unsigned), so vpdpbusd (unsigned x signed bytes) takes the weights
  as its unsigned operand and the int8 activations as they are;
- int32 lane 4r + q of the line (row r, q = 0..3) gets the exact dot of the row's elements
  4q..4q+3 and 16+4q..16+4q+3 with the activations: vpdpbusd starts from `lane_bias`,
  -12 x the sum of those activations (per token, block and q, precomputed), which takes
  off what the weights' offset of 12 adds;
- acc[lane] += float32(dot) * (step_b * 2^(e_rb - 127)), a multiply then an add (no FMA,
  so `mxfp4_rows` in _host_experts_kernels.py gives the same bits lane by lane).

The caller folds each row's 4 lanes as (l0 + l1) + (l2 + l3).
"""

from __future__ import annotations

import functools
import os

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

MAX_TOKENS = 4  # 4 tokens x 2 lines of float accumulators + decoded weights fit 32 registers
WEIGHT_OFFSET = 12  # 2 x E2M1 is in -12..12
# How far ahead of the line being decoded to prefetch the weights: one core's misses in
# flight otherwise cap its read rate well below its share of the memory bandwidth.
PREFETCH_BYTES = int(os.environ.get("BATCHGEN_HOST_PREFETCH", "2048"))
_E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12)
# vpshufb table: code -> 12 + 2 x E2M1 value (bit 3 of the code is the sign)
OFFSET_TABLE = [WEIGHT_OFFSET + v for v in _E2M1_X2] + [WEIGHT_OFFSET - v for v in _E2M1_X2]

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
