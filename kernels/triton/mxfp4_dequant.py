"""MXFP4 weights decoded to bf16 in memory, for the fused MoE at prefill sizes.

At a few tokens the MoE kernels decode MXFP4 codes in registers and never write a bf16
weight: the step is bound by the bytes it reads. At prefill sizes every token tile of an
expert decodes that expert's weights again (16K tokens, 64 experts: ~12 tiles of 128
tokens each), and the decode's ALU work is what the tensor cores wait for: on the H200 the
MXFP4 MoE at 16K Moonlight tokens runs at 314 TFLOP/s against bf16's 455
(docs/notes-gpu-kernels.md). Decoding each weight once into a bf16
scratch (read 0.5 + write 2 bytes per weight) and running the bf16 kernels is the other
way; the fused MoE config chooses it ("KERNEL": "dequant").

The decode is the MoE kernels' own (`_mxfp4_weight_rows`): exact, since the engine admits
MXFP4 scales only up to 2^1 (fused_moe.MXFP4_MAX_EXACT_SCALE). Torch twin:
kernels/reference/quant_formats.dequant_mxfp4; the @triton.jit body is in
_mxfp4_dequant_kernels.py.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._common import check_device, interpreting
from kernels.triton._mxfp4_dequant_kernels import mxfp4_dequant_kernel

# bytes of codes per program along a row (32 groups of 32 weights) and rows per program
BLOCK_BYTES = 512
BLOCK_ROWS = 16


def dequant_mxfp4(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., N, K/2] uint8 with scales [..., N, K/32] E8M0 -> bf16 [..., N, K]."""
    assert codes.dtype == torch.uint8 and scales.dtype == torch.uint8, (
        f"MXFP4 codes and scales must be uint8, got {codes.dtype} and {scales.dtype}"
    )
    kb = codes.shape[-1]
    assert kb % 16 == 0, f"MXFP4 rows must be whole 32-weight groups, got K/2 = {kb}"
    assert scales.shape == (*codes.shape[:-1], kb // 16), (
        f"scales must be {[*codes.shape[:-1], kb // 16]}, got {list(scales.shape)}"
    )
    assert codes.is_contiguous() and scales.is_contiguous(), "codes and scales must be contiguous"
    check_device(codes, scales)
    out = torch.empty((*codes.shape[:-1], 2 * kb), dtype=torch.bfloat16, device=codes.device)
    rows = codes.numel() // kb
    if rows:
        grid = (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(kb, BLOCK_BYTES))
        mxfp4_dequant_kernel[grid](
            codes, scales, out, rows, kb,
            BLOCK_R=BLOCK_ROWS, BLOCK_B=BLOCK_BYTES, F32_DOT=interpreting(),
            ASM=not interpreting(), num_warps=4,
        )  # fmt: skip
    return out
