"""@triton.jit body of kernels/triton/mxfp4_dequant.py; the decode is the MoE kernels' own
(_fused_moe_kernels._mxfp4_weight_rows)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._fused_moe_kernels import _mxfp4_factors, _mxfp4_weight_rows


@triton.jit
def mxfp4_dequant_kernel(
    codes_ptr,  # [R, K/2] uint8 (R rows of K values), low nibble = even k
    scales_ptr,  # [R, K/32] uint8 E8M0
    out_ptr,  # [R, K] bf16
    R,
    KB,  # K/2: code bytes per row
    BLOCK_R: tl.constexpr,
    BLOCK_B: tl.constexpr,  # code bytes per program, a multiple of 16 (one scale group)
    F32_DOT: tl.constexpr,
    ASM: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
    groups = tl.program_id(1) * (BLOCK_B // 16) + tl.arange(0, BLOCK_B // 16)
    mask_r = rows < R
    r64 = rows.to(tl.int64)[:, None]
    b = tl.load(codes_ptr + r64 * KB + cols[None, :],
                mask=mask_r[:, None] & (cols < KB)[None, :], other=0)  # fmt: skip
    s = tl.load(scales_ptr + r64 * (KB // 16) + groups[None, :],
                mask=mask_r[:, None] & (groups < KB // 16)[None, :], other=127)  # fmt: skip
    w = _mxfp4_weight_rows(b, _mxfp4_factors(s), F32_DOT, ASM)  # [BLOCK_R, 2 * BLOCK_B]
    ks = tl.program_id(1) * 2 * BLOCK_B + tl.arange(0, 2 * BLOCK_B)
    tl.store(out_ptr + r64 * (2 * KB) + ks[None, :], w.to(out_ptr.dtype.element_ty),
             mask=mask_r[:, None] & (ks < 2 * KB)[None, :])  # fmt: skip
