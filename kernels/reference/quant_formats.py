"""Decoders for the stored weight formats the GPU kernels read, and makers of random
weights in those formats (tests and benchmarks). A weight is [OUT, IN] (docs/shapes.md).

FP8 block-scaled (DeepSeek V3 / V4 dense): q E4M3 [OUT, IN], one scale per 128x128 block,
  float32 `weight_scale_inv` [ceil(OUT/128), ceil(IN/128)] (V3) or E8M0 uint8 (V4, 2^(s-127));
  W[n, k] = q[n, k] * s[n // 128, k // 128].
MXFP4 (V4 experts): uint8 [OUT, IN/2], the low nibble holds the even k; code -> E2M1 table;
  one E8M0 scale per 32 IN-values per row, scale [OUT, IN/32]; W = table[code] * 2^(s-127).
"""

from __future__ import annotations

import torch

from kernels.formats.e8m0 import e8m0_to_float
from kernels.formats.fp8 import BLOCK as FP8_BLOCK
from kernels.formats.mxfp4 import GROUP as MXFP4_GROUP
from kernels.formats.mxfp4 import e2m1_table, unpack_fp4


def block_scales_float(scale: torch.Tensor) -> torch.Tensor:
    """A block-scale tensor as float32, whether stored float32 (V3) or E8M0 uint8 (V4)."""
    if scale.dtype == torch.uint8:
        return e8m0_to_float(scale)
    if scale.dtype != torch.float32:
        raise ValueError(f"FP8 block scale must be float32 or uint8 (E8M0), got {scale.dtype}")
    return scale


def dequant_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., OUT, IN] E4M3 with [..., ceil(OUT/128), ceil(IN/128)] scales -> float32
    [..., OUT, IN]."""
    n, k = q.shape[-2:]
    s = block_scales_float(scale)
    s = s.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :]
    s = s.repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return q.to(torch.float32) * s


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[..., OUT, IN/2] uint8 nibbles with [..., OUT, IN/32] E8M0 scales -> float32
    [..., OUT, IN].

    Unlike kernels.formats.mxfp4.dequantize_mxfp4 (one 2-D weight, a row range), this takes
    stacked experts: any leading dimensions."""
    values = e2m1_table(packed.device)[unpack_fp4(packed).long()]  # [..., OUT, IN]
    s = e8m0_to_float(scale).repeat_interleave(MXFP4_GROUP, dim=-1)
    return values * s


def random_fp8_block(
    shape: tuple[int, ...], scale_dtype: torch.dtype = torch.float32, device="cpu", generator=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random E4M3 codes [..., OUT, IN] and block scales, values of order 1/sqrt(IN)."""
    *lead, n, k = shape
    q = (torch.randn(shape, generator=generator) * 2.0).to(torch.float8_e4m3fn)
    sshape = (*lead, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    exps = torch.randint(-10, -4, sshape, generator=generator)
    if scale_dtype == torch.uint8:
        scale = (exps + 127).to(torch.uint8)
    else:
        scale = torch.pow(2.0, exps.float()) * (1 + torch.rand(sshape, generator=generator))
    return q.to(device), scale.to(device)


def random_mxfp4(
    shape: tuple[int, ...], device="cpu", generator=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 weight for a logical [..., OUT, IN]: packed [..., OUT, IN/2], scales
    [..., OUT, IN/32]."""
    *lead, n, k = shape
    if k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs K divisible by {MXFP4_GROUP}, got K={k}")
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=generator, dtype=torch.int32)
    exps = torch.randint(-9, -5, (*lead, n, k // MXFP4_GROUP), generator=generator)
    return packed.to(torch.uint8).to(device), (exps + 127).to(torch.uint8).to(device)
