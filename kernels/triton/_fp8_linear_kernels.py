"""Triton bodies for fp8_linear.py: a GEMV kernel for decode-sized M (float32 FMAs, no
tensor cores), the tl.dot kernel for larger M, activation quantization for the native FP8
path and the dot kernel's split-K reduce.

Dot kernel tiles: BLOCK_K divides 128, so each K step lies in one 128-wide scale block and the scale
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
    SWAP_AB: tl.constexpr = False,
):
    """y = x @ dequant(W)^T over one [BLOCK_M, BLOCK_N] tile and 1/SPLIT_K of K.
    SWAP_AB: the tile is computed as W @ x^T, [BLOCK_N, BLOCK_M]. With the bf16 decode the
    decoded weights become wgmma's register operand (see _fused_moe_kernels) rather than a
    bf16 tile staged through shared memory; with NATIVE_FP8 the weight rows fill wgmma's
    64-row side, so a few tokens (the N side, 8 or more) still get wgmma, not mma.sync."""
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

    ws_row = ws_ptr + (offs_n // 128) * stride_wsn
    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for step in range(step_lo, step_hi):
            offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x_t = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None],
                          mask=mask_m[None, :] & mask_k[:, None], other=0.0)  # fmt: skip
            q = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
            ws = tl.load(ws_row + (step * BLOCK_K) // 128, mask=mask_n, other=0)
            if SCALE_E8M0:
                ws = e8m0_to_f32(ws)
            part = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
            if NATIVE_FP8:
                part = mma(q, x_t, part, F32_DOT)
                xs = tl.load(xs_ptr + offs_m * stride_xsm + (step * BLOCK_K) // 128,
                             mask=mask_m, other=0.0)  # fmt: skip
                acc_t += part * ws[:, None] * xs[None, :]
            else:
                part = mma(q.to(x_t.dtype), x_t, part, F32_DOT)
                acc_t += part * ws[:, None]
        y = y_ptr + pid_k * stride_ys + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y, acc_t.to(y_ptr.dtype.element_ty), mask=mask_m[None, :] & mask_n[:, None])
        return
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sm,
    BLOCK_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (BLOCK_ROWS rows, 128-block): s = amax / 448, q = x / s per row. Rows
    are batched: one program per (row, block) is thousands of tiny programs per launch at
    decode batch sizes, whose launches cost several times the work (docs/notes-gpu-kernels.md)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    kb = tl.program_id(1)
    offs = kb * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (offs[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12)
    s = amax / 448.0
    q = x / s[:, None]
    q = f32_to_e4m3_bits(q).to(tl.float8e4nv, bitcast=True)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + kb, s, mask=rows < M)


@triton.jit
def splitk_reduce_kernel(
    part_ptr,  # [SPLIT, M*N] float32 partial products
    y_ptr,  # [M*N] out, the activation dtype
    numel,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """y = sum over the split of the partials, cast once: one launch where torch's
    sum-then-cast takes two."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_gemv_kernel(
    # pointers
    x_ptr,  # [M, K] bf16/fp16 (or float32 when PRENORM), M <= M_PAD
    w_ptr,  # [N, K] E4M3 codes (an int8 view when BIT_DECODE)
    ws_ptr,  # [ceil(N/128), ceil(K/128)] float32 or E8M0 uint8
    y_ptr,  # [M, N] x's dtype (the residual's when PRENORM)
    part_ptr,  # [SPLIT_K, M, N] float32 partial sums (SPLIT_K > 1)
    count_ptr,  # [cdiv(N, BLOCK_N)] int32 arrival counters, zero on entry and on exit
    res_ptr,  # [M, K] the residual stream (PRENORM)
    norm_w_ptr,  # [K] the RMSNorm's weight (PRENORM)
    res_out_ptr,  # [M, K] out: x + residual (PRENORM)
    # sizes
    M,
    N,
    K,
    eps,
    # strides
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_ym,
    stride_res,
    # meta-parameters
    SCALE_E8M0: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VEC: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BIT_DECODE: tl.constexpr,
    PRENORM: tl.constexpr = False,
    NORM_BLOCK: tl.constexpr = 128,
):
    """y = x @ W^T for a few rows x, without tensor cores: decode-sized M multiplies each
    weight M times, so FMAs in registers beat a 16-row MMA tile of which M rows are used.

    A program owns BLOCK_N weight rows and 1/SPLIT_K of K. Each step it loads a
    [BLOCK_N, BLOCK_K] tile of codes viewed as [BLOCK_N, CHUNKS, VEC]: a thread holds VEC
    contiguous bytes of one row (a 16-byte vector load at VEC = 16), so the sum over the
    last axis stays in the thread and the cross-thread reduction runs once, after the loop.
    A chunk lies in one 128-wide scale block (VEC divides 128), so the block scale
    multiplies the chunk's partial dot, not each weight.

    SPLIT_K > 1: each program stores its float32 partial, then counts itself in; the last
    of a row block's SPLIT_K programs sums the partials in split order (deterministic) and
    writes y, all in this one launch (no zero-fill, no reduce launch).

    PRENORM: x is the float32 sum a residual block produced (the MoE's accumulator) and the
    product takes RMSNorm(x + residual) as kernels/triton/rmsnorm.py forms it: the sum
    rounded to the residual's dtype, its rms over the whole row (every program computes
    its rows' rms: two rows of K values from L2), the normalised row rounded again. The
    row-block-0 programs store the rounded sum as the new residual (res_out, never the
    residual read here). One launch, where a separate norm would take its own."""
    CHUNKS: tl.constexpr = BLOCK_K // VEC
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, M_PAD)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, CHUNKS) * VEC
    offs_v = tl.arange(0, VEC)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_steps = tl.cdiv(K, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, k_steps)

    # The product is 4-D [M_PAD, BLOCK_N, CHUNKS, VEC]. The weights are loaded 4-D (unit M
    # axis) and the activations 3-D, then expanded: that makes the weight load's layout (VEC
    # contiguous bytes per thread) the one the product and the sum over VEC use, and only
    # the small activation tile is moved between layouts (loading both 4-D let the compiler
    # pick the activations' layout and shuffle the float32 weights through shared memory).
    w_rows = w_ptr + offs_n[None, :, None, None] * stride_wn  # [1, BLOCK_N, 1, 1]
    x_rows = x_ptr + offs_m[:, None, None] * stride_xm  # [M_PAD, 1, 1]
    ws_rows = ws_ptr + (offs_n // 128)[:, None] * stride_wsn  # [BLOCK_N, 1]
    offs_kw = offs_c[None, None, :, None] + offs_v[None, None, None, :]  # [1, 1, CHUNKS, VEC]
    mask_wn = mask_n[None, :, None, None]
    k_next = step_lo * BLOCK_K + offs_kw
    q_next = tl.load(w_rows + k_next, mask=mask_wn & (k_next < K), other=0.0)
    if PRENORM:
        # The rows' rms while the first weight tile is in flight.
        res_rows = res_ptr + offs_m[:, None, None] * stride_res  # [M_PAD, 1, 1]
        res_out_rows = res_out_ptr + offs_m[:, None, None] * stride_res
        offs_d = tl.arange(0, NORM_BLOCK)
        sum_sq = tl.zeros((M_PAD,), tl.float32)
        for d0 in range(0, K, NORM_BLOCK):
            dk = d0 + offs_d
            mask_d = mask_m[:, None] & (dk < K)[None, :]
            h = tl.load(x_ptr + offs_m[:, None] * stride_xm + dk[None, :], mask=mask_d,
                        other=0.0).to(tl.float32)  # fmt: skip
            h += tl.load(res_ptr + offs_m[:, None] * stride_res + dk[None, :], mask=mask_d,
                         other=0.0).to(tl.float32)  # fmt: skip
            h = h.to(res_out_ptr.dtype.element_ty).to(tl.float32)
            sum_sq += tl.sum(h * h, axis=1)
        rstd = 1.0 / tl.sqrt(sum_sq / K + eps)
    acc = tl.zeros((M_PAD, BLOCK_N, CHUNKS), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        q = q_next
        # The next step's codes are requested before this step's math: two tiles in flight
        # per program (Triton pipelines only loads that feed tl.dot). The last step reloads
        # its own tile (an L1 hit): a mask on the runtime bound step_hi instead would lose
        # the 16-byte vector loads, which need masks constant over 16 bytes (K % 16 == 0).
        k_next = tl.minimum(step + 1, step_hi - 1) * BLOCK_K + offs_kw
        q_next = tl.load(w_rows + k_next, mask=mask_wn & (k_next < K), other=0.0)
        k_chunk = step * BLOCK_K + offs_c  # [CHUNKS] first k of each chunk
        if BIT_DECODE:
            # E4M3 s|eeee|mmm sign-extended and shifted left 20 puts eeee|mmm where float32
            # keeps its low exponent and top mantissa bits and copies s into bits 27..31;
            # clearing 27..30 leaves s|0000eeee|mmm0..0 = the code's value * 2^-120, exact
            # for normals, subnormals and zero (3 integer ops, no convert instruction).
            # -2014314496 is the mask 0x87F00000 as an int32.
            w = ((q.to(tl.int32) << 20) & -2014314496).to(tl.float32, bitcast=True)
        else:
            w = q.to(tl.float32)  # [1, BLOCK_N, CHUNKS, VEC]
        kx = k_chunk[None, :, None] + offs_v[None, None, :]  # [1, CHUNKS, VEC]
        mask_x = mask_m[:, None, None] & (kx < K)
        xk = tl.load(x_rows + kx, mask=mask_x, other=0.0)
        if PRENORM:
            h = xk.to(tl.float32) + tl.load(res_rows + kx, mask=mask_x, other=0.0).to(tl.float32)
            h = h.to(res_out_ptr.dtype.element_ty)
            if pid_n == 0:
                tl.store(res_out_rows + kx, h, mask=mask_x)
            w_norm = tl.load(norm_w_ptr + kx, mask=kx < K, other=0.0).to(tl.float32)
            xk = h.to(tl.float32) * rstd[:, None, None] * w_norm
            xk = xk.to(res_out_ptr.dtype.element_ty)
        xk = xk.to(tl.float32)[:, None, :, :]  # [M_PAD, 1, CHUNKS, VEC]
        part = tl.sum(w * xk, axis=3)  # [M_PAD, BLOCK_N, CHUNKS]
        s = tl.load(
            ws_rows + (k_chunk // 128)[None, :],
            mask=mask_n[:, None] & (k_chunk < K)[None, :],
            other=0,
        )  # [BLOCK_N, CHUNKS]
        if SCALE_E8M0:
            s = e8m0_to_f32(s)
        if BIT_DECODE:
            # Half of the 2^120 here, half after the loop: the running sums stay far from
            # the float32 subnormals; scales up to 2^67 stay finite.
            s = s * 1.152921504606847e18  # 2^60
        acc += part * s[None, :, :]
    if BIT_DECODE:
        acc = acc * 1.152921504606847e18  # 2^60
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]

    mask_y = mask_m[:, None] & mask_n[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_y)
    else:
        mn = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_k * M * N + mn, y, mask=mask_y)
        # Every thread's partial is stored before the one atomic that publishes them
        # (release); the last arriver's acquire makes all SPLIT_K partials visible to it.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
            for split in tl.static_range(SPLIT_K):
                total += tl.load(
                    part_ptr + split * M * N + mn, mask=mask_y, other=0.0, cache_modifier=".cg"
                )
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask_y)
            tl.store(count_ptr + pid_n, 0)  # zero again for the next launch on this stream
