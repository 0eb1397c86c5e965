"""Helpers shared by the Triton wrappers and kernels.

Interpreter hazard (triton 3.9): the interpreter stores bfloat16 as uint16
and its `tl.dot` multiplies those raw bit patterns, so a bf16 x bf16 dot returns garbage
(fp16 and fp8 operands are fine: it converts those to fp16 first). Kernels therefore
take an `F32_DOT` meta-parameter, set only under the interpreter, that upcasts both dot
operands to float32. On a GPU the operands stay bf16/fp8 and use the tensor cores.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels need CUDA tensors, or CPU tensors under the interpreter."""
    for t in tensors:
        if t.is_cuda:
            continue
        if not interpreting():
            raise ValueError(
                f"Triton kernels need CUDA tensors (got a {t.device} tensor); set "
                "TRITON_INTERPRET=1 to run them on the CPU interpreter"
            )


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 4 elsewhere (the interpreter's tests size
    their grids as for a small GPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@triton.jit
def mma(a, b, acc, F32_DOT: tl.constexpr):
    """acc + a @ b; in float32 under the interpreter (see the module docstring)."""
    if F32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def e8m0_to_f32(s):
    """2^(s-127) for E8M0 bytes s (uint8 0..254) as float32, built from the exponent bits.
    s = 0 is 2^-127, a float32 subnormal, which the shift cannot express."""
    si = s.to(tl.int32)
    bits = si << 23
    v = bits.to(tl.float32, bitcast=True)
    return tl.where(si == 0, 5.877471754111438e-39, v)


@triton.jit
def f32_to_e4m3_bits(v):
    """Round float32 to E4M3 (round to nearest even, saturating at +-448) and return the
    code as uint8. Written with integer ops because the interpreter's float8 downcast drops
    the carry when rounding overflows the mantissa (125.3 -> 64) and mishandles subnormals;
    on a GPU it gives the same bits as the hardware convert."""
    a = tl.minimum(tl.abs(v), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    r = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # keep 3 mantissa bits, RNE
    normal = ((((r >> 23) & 0xFF) - 120) << 3) | ((r >> 20) & 7)
    t = a * 512.0  # subnormal step is 2^-9
    n = tl.floor(t + 0.5)
    n = tl.where((n - t == 0.5) & ((n.to(tl.int32) & 1) == 1), n - 1.0, n)
    code = tl.where(a < 0.015625, n.to(tl.int32), normal)
    sign = ((v.to(tl.int32, bitcast=True) >> 31) & 1) << 7
    return (code | sign).to(tl.uint8)
