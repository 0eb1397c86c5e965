"""Triton body for token_mask.py."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def apply_token_bitmask_kernel(
    # pointers
    logits_ptr,  # [N, V] float, masked in place
    bitmask_ptr,  # [N, W] int32
    constrained_ptr,  # [N] int32: 0 leaves the row alone
    # sizes
    V,
    stride_l,
    stride_m,
    # meta-parameters
    BLOCK_V: tl.constexpr,  # a multiple of 32
):
    row = tl.program_id(0).to(tl.int64)
    if tl.load(constrained_ptr + row) == 0:
        return  # a free row reads nothing more
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    live = offs < V
    words = tl.load(bitmask_ptr + row * stride_m + offs // 32, mask=live, other=-1)
    allowed = ((words >> (offs % 32)) & 1) != 0  # arithmetic shift: bit 31 reads right
    tl.store(logits_ptr + row * stride_l + offs, float("-inf"), mask=live & ~allowed)
