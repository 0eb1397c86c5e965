"""E8M0 scales: an unsigned 8-bit exponent, value 2^(e - 127); 255 encodes NaN.

Used by MXFP4 (one scale per 32 values) and DeepSeek-V4's FP8 block scales. Checkpoints
store them as uint8 or torch.float8_e8m0fnu; both are handled as their raw bytes here.
"""

from __future__ import annotations

import torch

E8M0_BIAS = 127
E8M0_NAN = 255


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw uint8 codes of an E8M0 tensor stored as uint8, int8 or float8_e8m0fnu."""
    if scale.dtype == torch.uint8:
        return scale
    if scale.dtype in (torch.int8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        return scale.view(torch.uint8)
    raise TypeError(f"E8M0 scales must be uint8 or float8_e8m0fnu, got {scale.dtype}")


def check_e8m0(scale: torch.Tensor, name: str) -> None:
    """Reject the NaN code (255) with an error naming the tensor and the first bad index."""
    codes = e8m0_bytes(scale)
    bad = codes == E8M0_NAN
    if bool(bad.any()):
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        count = int(bad.sum())
        raise ValueError(
            f"tensor {name!r}: E8M0 scale 255 (NaN) at index {first} ({count} such values); "
            "the checkpoint is corrupt or not in the E8M0 format"
        )


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as float32, exactly (built from the bits, including e = 0 -> 2^-127, a
    float32 subnormal). The NaN code is not checked here; loaders call check_e8m0 once."""
    e = e8m0_bytes(scale).to(torch.int32)
    bits = torch.where(e > 0, e << 23, torch.full_like(e, 1 << 22))
    return bits.view(torch.float32)


def float_to_e8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0), as an E8M0 code clamped to [0, 254]."""
    exponent = torch.ceil(torch.log2(x.float().clamp_min(2.0**-127)))
    return (exponent + E8M0_BIAS).clamp(0, 254).to(torch.uint8)
