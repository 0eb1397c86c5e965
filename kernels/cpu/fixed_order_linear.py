"""y = x W^T in float32 on the CPU with one fixed summation order per output: a row's bits
do not depend on how many rows share the call, and the weight is read once per call.

The order, for the output (m, n) of K products p_k = x[m, k] * w[n, k] (each rounded to
float32, then added, never fused into an FMA):

- 16 lanes: lane j sums p_k for k = j, j + 16, j + 32, ... below 16 * (K // 16), in k order,
  starting from 0.
- the lanes are folded by halves: j + 8 onto j, then j + 4, j + 2, j + 1 (lane 0 is the sum).
- the tail products k = 16 * (K // 16) .. K - 1 are added to that sum in k order.

A hand-built LLVM loop (a numba intrinsic) holds a tile of R rows x C outputs as R * C
16-lane vectors in registers and runs that order for each of them; tiles of other sizes
(the row and column tails, a call of one row) run the same order, so every row count gives
the same bits. The instructions carry no fast-math flags, so LLVM may not reorder or fuse
them. `fixed_order_linear_reference` is the plain torch twin of the same order, bit-equal.

Threads: the outputs are split in column ranges over `torch.get_num_threads()` Python
threads (numba releases the GIL); each output is computed by one thread in the order
above, so the split changes no bits. numba's own parallel pools are not used: their
threads spin against torch's OpenMP threads on a small machine (docs/notes-cpu-decode.md).

Legend: M = rows of x, N = outputs (rows of w), K = inputs.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numba
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16
TILE_ROWS = 4  # R: 4 x 4 accumulators + 4 x and 4 w vectors fit in 32 AVX-512 registers
TILE_COLS = 4  # C
# Rows per pass over the weight: their x (64 x K floats) stays in L2 while the weight streams.
ROW_BLOCK = 64
# A call runs on more than one thread when its weight has this many elements (streaming a
# weight from memory takes two cores to saturate) or it has this many multiply-adds; below
# both, a thread hand-off costs about what it saves (measured on the 2-core dev machine).
PARALLEL_MIN_WEIGHT = 1 << 22
PARALLEL_MIN_WORK = 1 << 27

_F32 = ir.FloatType()
_I64 = ir.IntType(64)
_VEC = ir.VectorType(_F32, LANES)


def _load(builder, ptr, typ):
    if getattr(ptr.type, "is_opaque", False):
        return builder.load(ptr, typ=typ, align=4)
    return builder.load(builder.bitcast(ptr, typ.as_pointer()), align=4)


def _fold(builder, v):
    """Lane 0 of the halving fold: j + 8 onto j, then + 4, + 2, + 1."""
    width = LANES
    while width > 1:
        half = width // 2
        lo = builder.shuffle_vector(v, v, _lanes(0, half))
        hi = builder.shuffle_vector(v, v, _lanes(half, half))
        v = builder.fadd(lo, hi)
        width = half
    return builder.extract_element(v, _i32(0))


def _i32(i: int):
    return ir.Constant(ir.IntType(32), i)


def _lanes(start: int, count: int):
    """The shuffle mask picking lanes start .. start + count - 1."""
    return ir.Constant(ir.VectorType(ir.IntType(32), count), list(range(start, start + count)))


@functools.cache
def _tile(rows: int, cols: int):
    """An intrinsic tile(x, w, y, m, n): y[m:m+rows, n:n+cols] = the lane-and-fold part of
    x W^T (the K tail is added by the caller)."""

    @intrinsic
    def tile(typingctx, x, w, y, m, n):
        sig = types.void(x, w, y, m, n)

        def codegen(context, builder, signature, args):
            xa = context.make_array(signature.args[0])(context, builder, args[0])
            wa = context.make_array(signature.args[1])(context, builder, args[1])
            ya = context.make_array(signature.args[2])(context, builder, args[2])
            m_, n_ = args[3], args[4]
            k = cgutils.unpack_tuple(builder, xa.shape)[1]
            ldy = cgutils.unpack_tuple(builder, ya.shape)[1]
            blocks = builder.sdiv(k, ir.Constant(_I64, LANES))
            x_rows = [
                builder.gep(xa.data, [builder.mul(builder.add(m_, ir.Constant(_I64, r)), k)])
                for r in range(rows)
            ]
            w_rows = [
                builder.gep(wa.data, [builder.mul(builder.add(n_, ir.Constant(_I64, c)), k)])
                for c in range(cols)
            ]
            entry = builder.block
            header = builder.append_basic_block("tile.header")
            body = builder.append_basic_block("tile.body")
            done = builder.append_basic_block("tile.done")
            builder.branch(header)

            builder.position_at_end(header)
            i = builder.phi(_I64)
            acc = [[builder.phi(_VEC) for _ in range(cols)] for _ in range(rows)]
            zero = ir.Constant(_VEC, [0.0] * LANES)
            i.add_incoming(ir.Constant(_I64, 0), entry)
            for row in acc:
                for a in row:
                    a.add_incoming(zero, entry)
            builder.cbranch(builder.icmp_signed("<", i, blocks), body, done)

            builder.position_at_end(body)
            off = builder.mul(i, ir.Constant(_I64, LANES))
            wv = [_load(builder, builder.gep(p, [off]), _VEC) for p in w_rows]
            for r in range(rows):
                xv = _load(builder, builder.gep(x_rows[r], [off]), _VEC)
                for c in range(cols):
                    new = builder.fadd(acc[r][c], builder.fmul(xv, wv[c]))
                    acc[r][c].add_incoming(new, body)
            i.add_incoming(builder.add(i, ir.Constant(_I64, 1)), body)
            builder.branch(header)

            builder.position_at_end(done)
            for r in range(rows):
                y_row = builder.gep(
                    ya.data, [builder.mul(builder.add(m_, ir.Constant(_I64, r)), ldy)]
                )
                for c in range(cols):
                    out = builder.gep(y_row, [builder.add(n_, ir.Constant(_I64, c))])
                    builder.store(_fold(builder, acc[r][c]), out)
            return context.get_dummy_value()

        return sig, codegen

    return tile


_TILE_RC = _tile(TILE_ROWS, TILE_COLS)
_TILE_1C = _tile(1, TILE_COLS)
_TILE_R1 = _tile(TILE_ROWS, 1)
_TILE_11 = _tile(1, 1)


@numba.njit(nogil=True, boundscheck=False, cache=True)
def _linear_columns(x, w, y, n0, n1):
    """y[:, n0:n1] of x W^T (x [M, K], w [N, K], y [M, N], all C-contiguous float32)."""
    m_total, k = x.shape
    for m0 in range(0, m_total, ROW_BLOCK):
        m1 = min(m_total, m0 + ROW_BLOCK)
        n = n0
        while n + TILE_COLS <= n1:
            m = m0
            while m + TILE_ROWS <= m1:
                _TILE_RC(x, w, y, m, n)
                m += TILE_ROWS
            while m < m1:
                _TILE_1C(x, w, y, m, n)
                m += 1
            n += TILE_COLS
        while n < n1:
            m = m0
            while m + TILE_ROWS <= m1:
                _TILE_R1(x, w, y, m, n)
                m += TILE_ROWS
            while m < m1:
                _TILE_11(x, w, y, m, n)
                m += 1
            n += 1
    tail = (k // LANES) * LANES
    if tail < k:
        for m in range(m_total):
            for n in range(n0, n1):
                s = y[m, n]
                for kk in range(tail, k):
                    s = s + x[m, kk] * w[n, kk]
                y[m, n] = s


_pool: ThreadPoolExecutor | None = None


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool
    if _pool is None or _pool._max_workers < workers:
        _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fixed-order-linear")
    return _pool


def fixed_order_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N], float32 CPU tensors, each output summed in
    the module's fixed order (bit-equal to `fixed_order_linear_reference`)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise TypeError(f"fixed_order_linear takes float32, got {x.dtype} and {weight.dtype}")
    lead = x.shape[:-1]
    n, k = weight.shape
    x2 = x.detach().reshape(-1, k).contiguous()  # [M, K]
    w = weight.detach().contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)  # [M, N]
    xn, wn, yn = x2.numpy(), w.numpy(), y.numpy()
    threads = min(torch.get_num_threads(), max(1, n // (TILE_COLS * 8)))
    if threads <= 1 or (n * k < PARALLEL_MIN_WEIGHT and m * n * k < PARALLEL_MIN_WORK):
        _linear_columns(xn, wn, yn, 0, n)
    else:
        # column ranges on TILE_COLS boundaries; the caller's thread takes the last one
        step = -(-n // (threads * TILE_COLS)) * TILE_COLS
        bounds = [(lo, min(n, lo + step)) for lo in range(0, n, step)]
        pool = _executor(len(bounds) - 1)
        futures = [pool.submit(_linear_columns, xn, wn, yn, lo, hi) for lo, hi in bounds[:-1]]
        _linear_columns(xn, wn, yn, *bounds[-1])
        for f in futures:
            f.result()
    return y.reshape(*lead, n)


def fixed_order_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain torch twin of `fixed_order_linear`: the same order, spelled out as float32
    elementwise ops (each a single IEEE rounding), so the two are bit-equal."""
    n, k = weight.shape
    x2 = x.reshape(-1, k).float()  # [M, K]
    w = weight.float()
    blocks = k // LANES
    lanes = torch.zeros(x2.shape[0], n, LANES)  # [M, N, 16]
    for i in range(blocks):
        xs = x2[:, None, i * LANES : (i + 1) * LANES]  # [M, 1, 16]
        ws = w[None, :, i * LANES : (i + 1) * LANES]  # [1, N, 16]
        lanes = lanes + xs * ws
    width = LANES
    while width > 1:
        width //= 2
        lanes = lanes[..., :width] + lanes[..., width : 2 * width]
    y = lanes[..., 0]  # [M, N]
    for kk in range(blocks * LANES, k):
        y = y + x2[:, kk : kk + 1] * w[None, :, kk]
    return y.reshape(*x.shape[:-1], n)
