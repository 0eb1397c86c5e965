"""MXFP4 weights: E2M1 values packed two per byte along the input dimension, with one
E8M0 scale per 32 input values of each row (DeepSeek-V4's expert format).

byte = W[o, k // 2]; code = (byte >> 4 * (k % 2)) & 0xF, so the low nibble holds the even k.
value = E2M1[code] * 2^(S[o, k // 32] - 127).
"""

from __future__ import annotations

import torch

from kernels.formats.e8m0 import e8m0_to_float, float_to_e8m0_ceil

GROUP = 32
FP4_MAX = 6.0
# code -> value; bit 3 is the sign (code 8 is negative zero)
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., K] (uint8, 0..15) -> bytes [..., K/2], low nibble = even k."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the packed dimension must be even, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    if bool((c > 15).any()):
        raise ValueError("FP4 codes must be in 0..15")
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] -> codes [..., K] (uint8, 0..15)."""
    p = packed.view(torch.uint8) if packed.dtype == torch.int8 else packed
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


def dequantize_mxfp4(
    packed: torch.Tensor,
    scales: torch.Tensor,
    row_start: int = 0,
    row_end: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows row_start:row_end of the weight [rows, K] as `dtype`."""
    row_end = packed.shape[0] if row_end is None else row_end
    codes = unpack_fp4(packed[row_start:row_end]).long()  # [R, K]
    values = e2m1_table(packed.device)[codes]
    s = e8m0_to_float(scales[row_start:row_end])  # [R, K/32]
    rows, k = values.shape
    return (values.view(rows, k // GROUP, GROUP) * s[:, :, None]).view(rows, k).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [OUT, IN/2], scales uint8 E8M0 [OUT, IN/32]); IN must be a multiple of
    32.

    The scale is the smallest power of two that brings the group's absolute max to <= 6;
    values round to the nearest E2M1 value (ties to the larger magnitude)."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"MXFP4 needs the input dimension to be a multiple of {GROUP}, got {k}")
    groups = w.float().view(n, k // GROUP, GROUP)
    amax = groups.abs().amax(dim=-1)  # [OUT, IN/32]
    scales = float_to_e8m0_ceil(torch.where(amax > 0, amax / FP4_MAX, torch.ones_like(amax)))
    scaled = groups / e8m0_to_float(scales)[:, :, None]
    return pack_fp4(nearest_e2m1_codes(scaled).view(n, k)), scales


def nearest_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 code nearest each value (magnitudes above 6 saturate to 6)."""
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=x.device)
    midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
    mag_code = torch.bucketize(x.abs(), midpoints, right=True).to(torch.uint8)
    sign = (torch.signbit(x)).to(torch.uint8) << 3
    return mag_code | sign
