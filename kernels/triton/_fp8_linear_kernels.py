"""Triton bodies for fp8_linear.py.

Tiles: BLOCK_K divides 128, so each K step lies in one 128-wide scale block and the scale
is applied to the partial product (acc += (x @ q) * s[n_block]), not per weight element:
the E4M3 -> bf16 convert is exact and the only per-element work on the weight.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import e8m0_to_f32, f32_to_e4m3_bits, mma


@triton.jit
def fp8_block_linear_kernel(
    # pointers
    x_ptr,  # [M, K] bf16/fp16, or E4M3 codes when NATIVE_FP8
    xs_ptr,  # [M, ceil(K/128)] float32 activation scales (NATIVE_FP8 only)
    w_ptr,  # [N, K] E4M3
    ws_ptr,  # [ceil(N/128), ceil(K/128)] float32 or E8M0 uint8
    y_ptr,  # [SPLIT_K, M, N]: float32 partials when SPLIT_K > 1, else y's dtype
    # sizes
    M,
    N,
    K,
    # strides
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_xsm,
    stride_ys,
    stride_ym,
    SPLIT_K,  # runtime: the number of K splits (grid axis 2)
    # meta-parameters
    SCALE_E8M0: tl.constexpr,
    NATIVE_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, k_steps)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ws_row = ws_ptr + (offs_n // 128) * stride_wsn
    for step in range(step_lo, step_hi):
        offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        q = tl.load(
            w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N] E4M3
        kb = (step * BLOCK_K) // 128
        ws = tl.load(ws_row + kb, mask=mask_n, other=0)
        if SCALE_E8M0:
            ws = e8m0_to_f32(ws)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if NATIVE_FP8:
            part = mma(x, q, part, F32_DOT)
            xs = tl.load(xs_ptr + offs_m * stride_xsm + kb, mask=mask_m, other=0.0)
            acc += part * xs[:, None] * ws[None, :]
        else:
            part = mma(x, q.to(x.dtype), part, F32_DOT)
            acc += part * ws[None, :]

    y = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def act_quant_kernel(
    x_ptr,  # [M, K] bf16
    q_ptr,  # [M, K] E4M3
    s_ptr,  # [M, ceil(K/128)] float32
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    BLOCK: tl.constexpr,
):
    """One program per (row, 128-block): s = amax / 448, q = x / s."""
    row = tl.program_id(0)
    kb = tl.program_id(1)
    offs = kb * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12)
    s = amax / 448.0
    q = x / s
    q = f32_to_e4m3_bits(q).to(tl.float8e4nv, bitcast=True)
    tl.store(q_ptr + row * stride_qm + offs, q, mask=mask)
    tl.store(s_ptr + row * stride_sm + kb, s)


@triton.jit
def splitk_reduce_kernel(
    part_ptr,  # [SPLIT, M*N] float32 partial products
    y_ptr,  # [M*N] out, the activation dtype
    numel,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y = sum over the split of the partials, cast once: one launch where torch's
    sum-then-cast took two."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
