"""@triton.jit body of kernels/triton/rmsnorm.py: one program per row."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rmsnorm_kernel(
    x_ptr,  # [rows, D]
    res_ptr,  # [rows, D] residual in (HAS_RES)
    w_ptr,  # [D]
    y_ptr,  # [rows, D]
    res_out_ptr,  # [rows, D] x + residual (HAS_RES)
    D,
    eps,
    stride_x,
    stride_res,
    stride_y,
    stride_res_out,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32)
        # The new residual is rounded to the stream's dtype, as an unfused add would be.
        x_round = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + offs, x_round, mask=mask)
        x = x_round.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + offs, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
