"""Triton bodies for fused_moe.py.

Each program owns one BLOCK_M tile of expert-grouped pairs (all of one expert, from
moe_align) and BLOCK_N output columns, and streams that expert's weight rows along K once.
Weight formats (WFMT): 0 bf16/fp16; 1 FP8 E4M3 with float32 128x128 block scales;
2 FP8 with E8M0 block scales; 3 MXFP4 (packed nibbles along K, E8M0 scale per 32 K;
BLOCK_K a multiple of 32).
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
        # Each 32-wide scale group of the K step is one sub-step, unrolled, so the scale
        # multiplies the partial product, not each weight; a wide BLOCK_K (64/128) puts the
        # groups' loads in flight together and cuts loop overhead. Even k live in the low
        # nibbles, odd k in the high ones: the activations are split the same way (two
        # strided loads) instead of interleaving decoded weights. A nibble becomes an fp16
        # with two masks and shifts: sign -> bit 15, exponent+mantissa -> bits 9..11 give
        # exactly E2M1 * 2^-14 (code 1 lands on the fp16 subnormal 2^-15), so the group
        # scale absorbs the 2^14.
        for g in tl.static_range(BLOCK_K // 32):
            kg = k0 + 32 * g
            offs_j = kg // 2 + tl.arange(0, 16)
            mask_j = offs_j < K // 2
            amask = mask_m[:, None] & mask_j[None, :]
            a_even = tl.load(a_ptr[:, None] + 2 * offs_j[None, :], mask=amask, other=0.0)
            a_odd = tl.load(a_ptr[:, None] + 2 * offs_j[None, :] + 1, mask=amask, other=0.0)
            # fp16 tensor cores: saturate rather than overflow activations beyond fp16.
            a_even = tl.minimum(tl.maximum(a_even.to(tl.float32), -65504.0), 65504.0)
            a_odd = tl.minimum(tl.maximum(a_odd.to(tl.float32), -65504.0), 65504.0)
            wmask = mask_n[None, :] & mask_j[:, None]
            b = tl.load(w_ptr + rows[None, :] * stride_wn + offs_j[:, None], mask=wmask, other=0)
            b = b.to(tl.int32)
            lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
            hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
            # A group past K has zero codes and activations; any finite scale will do.
            group = tl.minimum(kg // 32, K // 32 - 1)
            s = tl.load(ws_ptr + rows * stride_wsn + group, mask=mask_n, other=0)
            s = e8m0_to_f32(s) * 16384.0
            part = tl.zeros(acc.shape, dtype=tl.float32)
            part = mma(a_even.to(tl.float16), lo, part, F32_DOT)
            part = mma(a_odd.to(tl.float16), hi, part, F32_DOT)
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
def _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, BLOCK_M: tl.constexpr,
                DENSE: tl.constexpr):  # fmt: skip
    """(expert, pairs [BLOCK_M]) of tile pid_m. DENSE (one expert that every row uses, e.g.
    the shared expert): pairs are the rows themselves, no alignment read."""
    if DENSE:
        expert = pid_m * 0
        pairs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        expert = tl.load(block_expert_ptr + pid_m)
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs


@triton.jit
def moe_gate_up_kernel(
    # pointers
    x_ptr,  # [T, D] activations
    w_ptr,  # [E, 2I, D] (MXFP4: [E, 2I, D/2] uint8)
    ws_ptr,  # scales: FP8 [E, ceil(2I/128), ceil(D/128)]; MXFP4 [E, 2I, D/32]; else unused
    h_ptr,  # [P, I] out: silu(gate) * up per pair
    sorted_pairs_ptr,  # [max_blocks * BLOCK_M] int32 (unused when DENSE)
    block_expert_ptr,  # [max_blocks] int32 (unused when DENSE)
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
    DENSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pairs = _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, BLOCK_M, DENSE)
    if expert < 0:
        return
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
    topk_weights_ptr,  # [P] float32 routing weights (unused when DENSE: weight 1)
    y_ptr,  # [T, D] float32 accumulator: += weight * down(h) of each of the token's pairs
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
    stride_yt,
    # meta-parameters
    TOPK: tl.constexpr,
    WFMT: tl.constexpr,
    DENSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert, pairs = _tile_pairs(sorted_pairs_ptr, block_expert_ptr, pid_m, BLOCK_M, DENSE)
    if expert < 0:
        return
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
    if not DENSE:
        route_w = tl.load(topk_weights_ptr + pairs, mask=mask_m, other=0.0)
        acc = acc * route_w[:, None]
    # The combine: a tile holds one expert, so its rows are distinct tokens; tiles of other
    # experts add to the same rows, hence atomics (float32: the order changes only the
    # last bits, rounded away by the cast to bf16 in all but rare ties).
    y_out = y_ptr + (pairs // TOPK).to(tl.int64)[:, None] * stride_yt + offs_n[None, :]
    tl.atomic_add(y_out, acc, mask=mask_m[:, None] & mask_n[None, :], sem="relaxed")
