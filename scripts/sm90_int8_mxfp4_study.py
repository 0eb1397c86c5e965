"""Offline study (no GPU needed): would an int8 path cut the MXFP4 decode's instructions?

At 1-8 tokens the fused MoE's MXFP4 kernel is issue-bound (docs/notes-gpu-kernels.md,
session 4): ~9 PTX instructions per weight, where the H200's HBM delivers a weight every
~4 issue slots per SM. E2M1 x 2 is an exact int8 (0, +-1, 2, 3, 4, 6, 8, 12), so a 16-entry
table held in four registers maps nibbles to int8 with PTX `prmt` (byte permute), and dp4a
multiplies four of them by int8 activations (quantized per 32, the MXFP4 block) at once.

This script
1. checks that table decode (DECODE_ASM) against the format's values, emulating prmt's
   default mode bit for bit on every 16-bit nibble pattern (both register halves);
2. compiles a one-expert GEMV built on it for sm_90 (`triton.compile`, no GPU) and counts
   the PTX instructions in its K loop per weight, for a few tiles.

    python scripts/sm90_int8_mxfp4_study.py

The GEMV is a measuring device, not a kernel the engine runs: the real one needs the MoE
tiling (sorted pairs, gate+up, the down's combine) and a GPU run to time it.
"""

from __future__ import annotations

import collections
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# E2M1 magnitudes x 2 by the nibble's low 3 bits; negatives as int8 two's complement bytes
MAGNITUDES = [0, 1, 2, 3, 4, 6, 8, 12]


def _word(values: list[int]) -> int:
    return sum((v & 0xFF) << (8 * i) for i, v in enumerate(values))


POS0, POS1 = _word(MAGNITUDES[:4]), _word(MAGNITUDES[4:])
NEG0, NEG1 = _word([-v for v in MAGNITUDES[:4]]), _word([-v for v in MAGNITUDES[4:]])

# $2: 8 nibbles (elements 0..7 from the low bits) -> $0: int8 x 4 of elements 0..3,
# $1: of elements 4..7. Magnitudes from the positive and negative tables, then each byte
# picked from one or the other by its nibble's sign bit (shifted to select +4).
DECODE_ASM = f"""{{
.reg .b32 m, s, p, n, mh, sh;
and.b32 m, $2, 0x77777777;
shr.u32 s, $2, 1;
and.b32 s, s, 0x44444444;
or.b32 s, s, 0x32103210;
prmt.b32 p, {POS0:#x}, {POS1:#x}, m;
prmt.b32 n, {NEG0:#x}, {NEG1:#x}, m;
prmt.b32 $0, p, n, s;
shr.u32 mh, m, 16;
shr.u32 sh, s, 16;
prmt.b32 p, {POS0:#x}, {POS1:#x}, mh;
prmt.b32 n, {NEG0:#x}, {NEG1:#x}, mh;
prmt.b32 $1, p, n, sh;
}}"""


def prmt(a: int, b: int, c: int) -> int:
    """PTX prmt.b32 d, a, b, c (default mode): byte i of d is byte (c's nibble i & 7) of
    {b, a}, or that byte's sign replicated when the nibble's bit 3 is set."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        sel = (c >> 4 * i) & 0xF
        byte = src[sel & 7]
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def decode_emulated(q: int) -> list[int]:
    """DECODE_ASM instruction by instruction: the 8 int8 values of one code word."""
    m = q & 0x77777777
    s = ((q >> 1) & 0x44444444) | 0x32103210
    lo = prmt(prmt(POS0, POS1, m), prmt(NEG0, NEG1, m), s)
    hi = prmt(prmt(POS0, POS1, m >> 16), prmt(NEG0, NEG1, m >> 16), s >> 16)
    raw = [(lo >> 8 * i) & 0xFF for i in range(4)] + [(hi >> 8 * i) & 0xFF for i in range(4)]
    return [b - 256 if b >= 128 else b for b in raw]


def check_decode() -> int:
    """Mismatches against E2M1 x 2 over every 16-bit pattern in each half of the word."""
    bad = 0
    for q16 in range(1 << 16):
        q = q16 | (((q16 * 40503) & 0xFFFF) << 16)
        got = decode_emulated(q)
        for j in range(8):
            nibble = (q >> 4 * j) & 0xF
            want = (-1 if nibble & 8 else 1) * MAGNITUDES[nibble & 7]
            bad += got[j] != want
    return bad


@triton.jit
def int8_gemv_kernel(
    w_ptr,  # [N, K/8] int32: MXFP4 codes, 8 nibbles per word
    ws_ptr,  # [N, K/32] uint8 E8M0
    xq_ptr,  # [K/4] int32: int8 activations, 4 per word
    xs_ptr,  # [K/32] float32 activation scales (the table's x2 folded in)
    y_ptr,  # [N] float32
    K,
    stride_wn,
    stride_wsn,
    BLOCK_N: tl.constexpr,
    BLOCK_KW: tl.constexpr,  # code words per K step (4 per 32-weight block)
    DECODE: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_KW)
    offs_b = tl.arange(0, BLOCK_KW // 4)
    acc = tl.zeros([BLOCK_N, BLOCK_KW // 4], tl.float32)  # reduced once, after the loop
    for k0 in range(0, K // 8, BLOCK_KW):
        codes = tl.load(w_ptr + offs_n[:, None] * stride_wn + k0 + offs_w[None, :])
        lo, hi = tl.inline_asm_elementwise(DECODE, "=r,=r,r", [codes], dtype=(tl.int32, tl.int32),
                                           is_pure=True, pack=1)  # fmt: skip
        zero = tl.zeros([BLOCK_N, BLOCK_KW], tl.int32)
        x0 = tl.load(xq_ptr + 2 * (k0 + offs_w))[None, :] + zero
        x1 = tl.load(xq_ptr + 2 * (k0 + offs_w) + 1)[None, :] + zero
        dots = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [lo, x0, zero], dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
        dots = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [hi, x1, dots], dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
        block = tl.sum(tl.reshape(dots, [BLOCK_N, BLOCK_KW // 4, 4]), axis=2)
        e = tl.load(ws_ptr + offs_n[:, None] * stride_wsn + k0 // 4 + offs_b[None, :])
        sw = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(e - 127)
        acc += block.to(tl.float32) * sw * tl.load(xs_ptr + k0 // 4 + offs_b)[None, :]
    tl.store(y_ptr + offs_n, tl.sum(acc, axis=1))


def loop_counts(block_n: int, block_kw: int, warps: int = 4, stages: int = 3) -> tuple[int, dict]:
    """PTX instructions in the compiled K loop (per thread) and the commonest opcodes."""
    sig = dict(w_ptr="*i32", ws_ptr="*u8", xq_ptr="*i32", xs_ptr="*fp32", y_ptr="*fp32",
               K="i32", stride_wn="i32", stride_wsn="i32", BLOCK_N="constexpr",
               BLOCK_KW="constexpr", DECODE="constexpr")  # fmt: skip
    names = list(sig)
    # what the JIT would know of 16-byte aligned pointers and strides
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names[:8]}
    src = ASTSource(fn=int8_gemv_kernel, signature=sig, attrs=attrs,
                    constexprs=dict(BLOCK_N=block_n, BLOCK_KW=block_kw, DECODE=DECODE_ASM))  # fmt: skip
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 64),
                         options=dict(num_warps=warps, num_stages=stages)).asm["ptx"]  # fmt: skip
    loop = re.search(r"\$L__BB0_(\d+):[^\n]*Loop Header.*?@%p\d+ bra\s+\$L__BB0_\1;", ptx, re.S)
    ops: collections.Counter = collections.Counter()
    for line in loop.group(0).splitlines() if loop else []:
        words = line.split()
        if not words or words[0].startswith(("$", "//", "{", "}", ".", ";")):  # directives too
            continue
        ops[(words[1] if words[0].startswith("@") else words[0]).split(".")[0]] += 1
    return sum(ops.values()), dict(ops.most_common(8))


if __name__ == "__main__":
    print(f"table decode, mismatches over every nibble pattern: {check_decode()}")
    print(f"triton {triton.__version__}, sm_90 PTX of the GEMV's K loop:")
    for block_n, block_kw in ((32, 32), (64, 32)):
        n, ops = loop_counts(block_n, block_kw)
        per_thread = block_n * block_kw * 8 // 128
        print(f"  {block_n} rows x {block_kw * 8} weights per step: {n} instructions per thread "
              f"for {per_thread} weights, {n / per_thread:.2f} per weight; {ops}")  # fmt: skip
