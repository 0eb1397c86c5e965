"""Triton bodies for matmul.py: a tiled matmul whose launch configuration is fixed by the
operands' N and K alone, and the in-order sum of its K splits."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._common import mma


@triton.jit
def _k_range(a_rows, b_cols, mask_m, mask_n, k_lo, k_hi, stride_ak, stride_bk,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             IEEE: tl.constexpr, F32_DOT: tl.constexpr):  # fmt: skip
    """The [BLOCK_M, BLOCK_N] float32 sum over K in [k_lo, k_hi), in BLOCK_K steps from
    zero: a row's bits depend on the range and BLOCK_K, not on the tile (tl.dot's per-row
    result does not depend on M or N)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_hi
        a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(b_cols + offs_k[:, None] * stride_bk, mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0)  # fmt: skip
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = mma(a, b, acc, F32_DOT)
    return acc


@triton.jit
def fixed_matmul_kernel(
    a_ptr,  # [S, M, K]
    b_ptr,  # [S, N, K] through its strides (a weight [N, K], or [S, K, N] transposed)
    c_ptr,  # [S, M, N] in the output dtype, or [SPLIT_K, S, M, N] float32 partials
    M,
    N,
    K,
    stride_as,
    stride_am,
    stride_ak,
    stride_bs,
    stride_bn,
    stride_bk,
    stride_cp,  # between partials (SPLIT_K > 1, not INLINE)
    stride_cs,
    stride_cm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    INLINE: tl.constexpr,  # 1: this program sums the SPLIT_K ranges itself, in split order
    IEEE: tl.constexpr,  # float32 operands multiplied in float32, not tf32
    F32_DOT: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if INLINE:
        s = tl.program_id(2)
        split = 0
    else:
        s = tl.program_id(2) // SPLIT_K
        split = tl.program_id(2) % SPLIT_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # Split `split` takes whole BLOCK_K steps [k_lo, k_hi): a row's partial sums cover the
    # same K ranges at every M, and are added in split order (by split_sum_kernel, or here
    # when INLINE: the same float32 additions, without the partials' round trip).
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    a_rows = a_ptr + s.to(tl.int64) * stride_as + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b_ptr + s.to(tl.int64) * stride_bs + offs_n.to(tl.int64)[None, :] * stride_bn
    k_lo = split * steps * BLOCK_K
    acc = _k_range(a_rows, b_cols, mask_m, mask_n, k_lo, tl.minimum(K, k_lo + steps * BLOCK_K),
                   stride_ak, stride_bk, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, F32_DOT)  # fmt: skip
    if INLINE:
        for later in range(1, SPLIT_K):
            k_lo = later * steps * BLOCK_K
            acc += _k_range(a_rows, b_cols, mask_m, mask_n, k_lo,
                            tl.minimum(K, k_lo + steps * BLOCK_K), stride_ak, stride_bk,
                            BLOCK_M, BLOCK_N, BLOCK_K, IEEE, F32_DOT)  # fmt: skip
    c = c_ptr + s.to(tl.int64) * stride_cs
    if not INLINE:
        c += split.to(tl.int64) * stride_cp
    c = c + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def split_sum_kernel(part_ptr, out_ptr, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out = part[0] + part[1] + ... in that order (float32), cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for p in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + p * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
