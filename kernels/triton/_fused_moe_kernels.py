"""Triton bodies for fused_moe.py.

Each program owns one BLOCK_M tile of expert-grouped pairs (all of one expert, from
moe_align) and BLOCK_N output columns, and streams that expert's weight rows along K once.
Weight formats (WFMT): 0 bf16/fp16; 1 FP8 E4M3 with float32 128x128 block scales;
2 FP8 with E8M0 block scales; 3 MXFP4 (packed nibbles along K, E8M0 scale per 32 K; BLOCK_K must be 32).
Codes are decoded to the activation dtype in registers; nothing decoded is written back.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import e8m0_to_f32, mma


@triton.jit
def _expert_step(
    acc,
    a_ptr,  # activation rows of this tile: pointer to a[row, 0], [BLOCK_M] pointers
    mask_m,
    w_ptr,  # this expert's weight base
    ws_ptr,  # this expert's scale base
    rows,  # [BLOCK_N] weight rows (output columns)
    mask_n,
    k0,
    K,
    stride_wn,
    stride_wsn,
    WFMT: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] += a[:, k0:k0+BLOCK_K] @ W[rows, k0:k0+BLOCK_K]^T."""
    if WFMT == 3:
        # One K step is one 32-wide scale group (BLOCK_K == 32), so the scale multiplies the
        # partial product, not each weight. Even k live in the low nibbles, odd k in the high
        # ones: the activations are split the same way (two strided loads) instead of
        # interleaving decoded weights. A nibble becomes an fp16 with two masks and shifts:
        # sign -> bit 15, exponent+mantissa -> bits 9..11 give exactly E2M1 * 2^-14 (code 1
        # lands on the fp16 subnormal 2^-15), so the group scale absorbs the 2^14.
        HALF: tl.constexpr = BLOCK_K // 2
        offs_j = k0 // 2 + tl.arange(0, HALF)
        mask_j = offs_j < K // 2
        amask = mask_m[:, None] & mask_j[None, :]
        a_even = tl.load(a_ptr[:, None] + 2 * offs_j[None, :], mask=amask, other=0.0)
        a_odd = tl.load(a_ptr[:, None] + 2 * offs_j[None, :] + 1, mask=amask, other=0.0)
        # fp16 tensor cores: saturate rather than overflow activations beyond fp16's range.
        a_even = tl.minimum(tl.maximum(a_even.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        a_odd = tl.minimum(tl.maximum(a_odd.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        wmask = mask_n[None, :] & mask_j[:, None]
        b = tl.load(w_ptr + rows[None, :] * stride_wn + offs_j[:, None], mask=wmask, other=0)
        b = b.to(tl.int32)
        lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
        hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
        s = tl.load(ws_ptr + rows * stride_wsn + k0 // 32, mask=mask_n, other=0)
        s = e8m0_to_f32(s) * 16384.0
        part = tl.zeros(acc.shape, dtype=tl.float32)
        part = mma(a_even, lo, part, F32_DOT)
        part = mma(a_odd, hi, part, F32_DOT)
        acc += part * s[None, :]
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            a_ptr[:, None] + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + rows[None, :] * stride_wn + offs_k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )  # [BLOCK_K, BLOCK_N]
        if WFMT == 0:
            acc = mma(a, w, acc, F32_DOT)
        else:
            s = tl.load(ws_ptr + (rows // 128) * stride_wsn + k0 // 128, mask=mask_n, other=0)
            if WFMT == 2:
                s = e8m0_to_f32(s)
            part = tl.zeros(acc.shape, dtype=tl.float32)
            part = mma(a, w.to(a.dtype), part, F32_DOT)
            acc += part * s[None, :]
    return acc


@triton.jit
def moe_gate_up_kernel(
    # pointers
    x_ptr,  # [T, D] activations
    w_ptr,  # [E, 2I, D] (MXFP4: [E, 2I, D/2] uint8)
    ws_ptr,  # scales: FP8 [E, ceil(2I/128), ceil(D/128)]; MXFP4 [E, 2I, D/32]; else unused
    h_ptr,  # [P, I] out: silu(gate) * up per pair
    sorted_pairs_ptr,  # [max_blocks * BLOCK_M] int32
    block_expert_ptr,  # [max_blocks] int32
    # sizes
    num_pairs,
    D,
    I,
    # strides
    stride_xt,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_hp,
    # meta-parameters
    TOPK: tl.constexpr,
    WFMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < num_pairs
    a_rows = x_ptr + (pairs // TOPK).to(tl.int64) * stride_xt
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        acc_gate = _expert_step(acc_gate, a_rows, mask_m, w_e, ws_e, offs_n, mask_n, k0, D,
                                stride_wn, stride_wsn, WFMT, BLOCK_K, F32_DOT)  # fmt: skip
        acc_up = _expert_step(acc_up, a_rows, mask_m, w_e, ws_e, offs_n + I, mask_n, k0, D,
                              stride_wn, stride_wsn, WFMT, BLOCK_K, F32_DOT)  # fmt: skip
    h = acc_gate / (1.0 + tl.exp(-acc_gate)) * acc_up
    h_out = h_ptr + pairs.to(tl.int64)[:, None] * stride_hp + offs_n[None, :]
    tl.store(h_out, h.to(h_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def moe_down_kernel(
    # pointers
    h_ptr,  # [P, I]
    w_ptr,  # [E, D, I] (MXFP4: [E, D, I/2] uint8)
    ws_ptr,  # scales: FP8 [E, ceil(D/128), ceil(I/128)]; MXFP4 [E, D, I/32]
    topk_weights_ptr,  # [P] float32 routing weights
    y_ptr,  # [P, D] out: weight * down(h) per pair
    sorted_pairs_ptr,
    block_expert_ptr,
    # sizes
    num_pairs,
    D,
    I,
    # strides
    stride_hp,
    stride_we,
    stride_wn,
    stride_wse,
    stride_wsn,
    stride_yp,
    # meta-parameters
    WFMT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < num_pairs
    a_rows = h_ptr + pairs.to(tl.int64) * stride_hp
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    ws_e = ws_ptr + expert.to(tl.int64) * stride_wse
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        acc = _expert_step(acc, a_rows, mask_m, w_e, ws_e, offs_n, mask_n, k0, I,
                           stride_wn, stride_wsn, WFMT, BLOCK_K, F32_DOT)  # fmt: skip
    route_w = tl.load(topk_weights_ptr + pairs, mask=mask_m, other=0.0)
    acc = acc * route_w[:, None]
    y_out = y_ptr + pairs.to(tl.int64)[:, None] * stride_yp + offs_n[None, :]
    tl.store(y_out, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
