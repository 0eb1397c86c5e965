"""A grammar's token bitmask applied to logits on the GPU, in place, with no host sync.

logits [N, V] float32/bf16 (row-major), bitmask [N, ceil(V/32)] int32 (bit v % 32 of word
v // 32 set: token v allowed), constrained [N] int32 (0: the row has no grammar and is
skipped after one load). Every argument is a device tensor of fixed shape, so the launch
sits inside a captured decode graph; the twin is kernels/reference/token_mask.py.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._common import check_device
from kernels.triton._token_mask_kernels import apply_token_bitmask_kernel


def apply_token_bitmask(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    constrained: torch.Tensor,
    block_v: int = 4096,
) -> torch.Tensor:
    """Sets logits[i, v] = -inf where row i is constrained and bit v is clear; returns
    `logits`."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be a row-major [N, V]"
    n, v = logits.shape
    words = -(-v // 32)
    assert bitmask.dtype == torch.int32, f"bitmask must be int32, got {bitmask.dtype}"
    assert bitmask.dim() == 2 and bitmask.shape[0] == n and bitmask.shape[1] >= words, (
        f"bitmask must be [{n}, >= {words}], got {list(bitmask.shape)}"
    )
    assert bitmask.stride(-1) == 1, "bitmask rows must be contiguous"
    assert constrained.shape == (n,) and constrained.dtype == torch.int32, (
        f"constrained must be int32 [{n}], got {constrained.dtype} {list(constrained.shape)}"
    )
    check_device(logits, bitmask, constrained)
    if not n:
        return logits
    block = max(32, min(block_v, triton.next_power_of_2(v)))
    apply_token_bitmask_kernel[(n, triton.cdiv(v, block))](
        logits, bitmask, constrained, v, logits.stride(0), bitmask.stride(0), BLOCK_V=block,
    )  # fmt: skip
    return logits
