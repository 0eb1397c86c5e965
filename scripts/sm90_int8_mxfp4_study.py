"""Offline study (no GPU needed): instructions per MXFP4 weight in the fused MoE's K loops.

At 1-8 tokens the MMA kernels (kernels/triton/_fused_moe_kernels.py) are issue-bound: the
H200's HBM delivers a weight every ~4 issue slots per SM. The int8 path
(kernels/triton/_moe_int8_kernels.py) decodes E2M1 x 2 as exact int8 through a byte-permute
table and multiplies with dp4a. This script
1. checks the table decode's PTX (`_DECODE_ASM`) against the format, emulating prmt's
   default mode bit for bit on every 16-bit nibble pattern in both halves of a word;
2. compiles the int8 kernels and the MMA kernel's one-token winner for sm_90
   (`triton.compile`, no GPU) and counts the PTX instructions of their K loops per
   thread and per weight.

    python scripts/sm90_int8_mxfp4_study.py      # with the GPU image's triton for its PTX

Counts are static: one pass of the loop body, directives left out. They say what issue
slots a step needs, not how fast it runs; only a GPU run times it.
"""

from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.triton import _fused_moe_kernels, _moe_int8_kernels  # noqa: E402

E2M1_X2 = [0, 1, 2, 3, 4, 6, 8, 12]


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


def run_decode_asm(q: int) -> list[int]:
    """_DECODE_ASM executed line by line (and, shr, or, prmt only) on one code word."""
    regs = {"$2": q}
    for line in _moe_int8_kernels._DECODE_ASM.value.splitlines():
        m = re.match(r"(\w+)\.\w+\s+([$\w]+),\s*([$\w]+),\s*([$\w]+)(?:,\s*([$\w]+))?;", line)
        if not m:
            continue
        op, dst, *srcs = m.groups()
        vals = [regs[s] if s in regs else int(s, 0) for s in srcs if s is not None]
        regs[dst] = {
            "and": lambda v: v[0] & v[1],
            "shr": lambda v: v[0] >> v[1],
            "or": lambda v: v[0] | v[1],
            "prmt": lambda v: prmt(*v),
        }[op](vals) & 0xFFFFFFFF
    raw = [(regs["$0"] >> 8 * i) & 0xFF for i in range(4)]
    raw += [(regs["$1"] >> 8 * i) & 0xFF for i in range(4)]
    return [b - 256 if b >= 128 else b for b in raw]


def check_decode() -> int:
    """Mismatches against E2M1 x 2 over every 16-bit pattern in each half of the word."""
    bad = 0
    for q16 in range(1 << 16):
        q = q16 | (((q16 * 40503) & 0xFFFF) << 16)
        got = run_decode_asm(q)
        for j in range(8):
            nibble = (q >> 4 * j) & 0xF
            bad += got[j] != (-1 if nibble & 8 else 1) * E2M1_X2[nibble & 7]
    return bad


def loop_instructions(fn, signature: dict, constexprs: dict, warps: int = 4) -> list[int]:
    """PTX instructions per thread in each K loop of `fn` compiled for sm_90."""
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    names = list(sig)
    # what the JIT knows of 16-byte aligned pointers, strides and sizes
    aligned = [n for n in names if sig[n] != "constexpr" and n != "num_pairs"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=warps, num_stages=3)).asm["ptx"]  # fmt: skip
    counts = []
    for loop in re.finditer(r"\$L__BB0_(\d+):[^\n]*Loop Header.*?@%p\d+ bra\s+\$L__BB0_\1;",
                            ptx, re.S):  # fmt: skip
        ops: collections.Counter = collections.Counter()
        for line in loop.group(0).splitlines():
            words = line.split()
            if words and not words[0].startswith(("$", "//", "{", "}", ".", ";")):
                ops[(words[1] if words[0].startswith("@") else words[0]).split(".")[0]] += 1
        counts.append(sum(ops.values()))
    return counts


_I32, _U8, _F32, _BF16 = "*i32", "*u8", "*fp32", "*bf16"
_SIZES = dict(num_pairs="i32", D="i32", I="i32")
_INT8_SIZES = dict(_SIZES, K_WORDS="i32")
INT8_GATE_UP = dict(xq_ptr=_I32, xs_ptr=_F32, w_ptr=_I32, ws_ptr=_U8, hq_ptr=_I32, hs_ptr=_F32,
                    sorted_pairs_ptr=_I32, block_expert_ptr=_I32, **_INT8_SIZES,
                    **{f"stride_{s}": "i32" for s in ("xq", "xs", "we", "wn", "wse", "wsn", "hq",
                                                     "hs")})  # fmt: skip
INT8_DOWN = dict(hq_ptr=_I32, hs_ptr=_F32, w_ptr=_I32, ws_ptr=_U8, topk_weights_ptr=_F32,
                 y_ptr=_F32, sorted_pairs_ptr=_I32, block_expert_ptr=_I32, **_INT8_SIZES,
                 **{f"stride_{s}": "i32" for s in ("hq", "hs", "we", "wn", "wse", "wsn", "yt")})  # fmt: skip
MMA_GATE_UP = dict(x_ptr=_BF16, w_ptr=_U8, ws_ptr=_U8, h_ptr=_BF16, sorted_pairs_ptr=_I32,
                   block_expert_ptr=_I32, part_ptr=_F32, counters_ptr=_I32, **_SIZES,
                   **{f"stride_{s}": "i32" for s in ("xt", "we", "wn", "wse", "wsn", "hp")})  # fmt: skip


def main() -> None:
    print(f"table decode (_DECODE_ASM), mismatches over every nibble pattern: {check_decode()}")
    print(f"triton {triton.__version__}, sm_90 PTX, K loop instructions per thread (4 warps):")
    # the MMA kernel's tuned one-token config on the H200 (SWAP_AB, 64 rows, 128 deep)
    mma = dict(TOPK=6, WFMT=3, DENSE=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, F32_DOT=False,
               SWAP_AB=True, GU_SPLIT_K=2, GROUP_M=1)  # fmt: skip
    n = loop_instructions(_fused_moe_kernels.moe_gate_up_kernel, MMA_GATE_UP, mma)[0]
    print(f"  MMA gate+up, 64 rows x 128: {n} for 64 weights, {n / 64:.2f} per weight")
    for block_n, block_k in ((32, 256), (64, 256), (64, 512)):
        meta = dict(TOPK=6, BLOCK_N=block_n, BLOCK_K=block_k, ASM=True, PREFETCH=True)
        for name, fn, sig, rows in (("gate+up", _moe_int8_kernels.moe_gate_up_int8_kernel,
                                     INT8_GATE_UP, 2 * block_n),
                                    ("down", _moe_int8_kernels.moe_down_int8_kernel, INT8_DOWN,
                                     block_n)):  # fmt: skip
            n = loop_instructions(fn, sig, meta)[0]
            weights = rows * block_k // 128
            print(
                f"  int8 {name}, {block_n} x {block_k}: {n} for {weights} weights, "
                f"{n / weights:.2f} per weight"
            )


if __name__ == "__main__":
    main()
