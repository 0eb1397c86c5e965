"""FP8 E4M3 weights with one scale per 128x128 block (DeepSeek-V3 / V4 checkpoints).

W[o, i] = q[o, i] * s[o // 128, i // 128]. DeepSeek-V3 stores s as float32
(`weight_scale_inv`, the inverse of the quantization scale); DeepSeek-V4 stores it as an
E8M0 power of two (`scale`). Edge blocks are partial: the scale grid is
[ceil(out/128), ceil(in/128)].
"""

from __future__ import annotations

import torch

from kernels.formats.e8m0 import e8m0_to_float, float_to_e8m0_ceil

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def scale_grid(out_features: int, in_features: int, block: int = BLOCK) -> tuple[int, int]:
    return (-(-out_features // block), -(-in_features // block))


def fp8_to_bits(codes: torch.Tensor) -> torch.Tensor:
    """The raw byte of each E4M3 value (pack: the storage form)."""
    if codes.dtype != FP8_DTYPE:
        raise TypeError(f"expected {FP8_DTYPE}, got {codes.dtype}")
    return codes.view(torch.uint8)


def bits_to_fp8(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret bytes as E4M3 values (unpack)."""
    if bits.dtype not in (torch.uint8, torch.int8):
        raise TypeError(f"expected uint8 bytes, got {bits.dtype}")
    return bits.view(FP8_DTYPE)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as float32 whichever way they are stored (float32/bf16 or E8M0)."""
    if scale.dtype in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)):
        return e8m0_to_float(scale)
    return scale.float()


def expand_block_scales(
    scale: torch.Tensor, rows: int, cols: int, row_start: int = 0, block: int = BLOCK
) -> torch.Tensor:
    """Per-element float32 scales [rows, cols] for weight rows row_start..row_start+rows."""
    s = scale_to_float(scale)
    first, last = row_start // block, (row_start + rows - 1) // block + 1
    s = s[first:last].repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    offset = row_start - first * block
    return s[offset : offset + rows, :cols]


def dequantize_fp8_block(
    codes: torch.Tensor,
    scale: torch.Tensor,
    row_start: int = 0,
    row_end: int | None = None,
    dtype: torch.dtype = torch.float32,
    block: int = BLOCK,
) -> torch.Tensor:
    """Rows row_start:row_end of the weight as `dtype` (only those rows are materialised)."""
    row_end = codes.shape[0] if row_end is None else row_end
    q = codes[row_start:row_end].float()
    s = expand_block_scales(scale, row_end - row_start, codes.shape[1], row_start, block)
    return (q * s).to(dtype)


def quantize_fp8_block(
    w: torch.Tensor, scale_format: str = "float32", block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [out, in] E4M3, scales [ceil(out/b), ceil(in/b)]) with the block's absolute
    max mapped to 448. scale_format "float32" gives V3's weight_scale_inv; "e8m0" rounds the
    scale up to a power of two (uint8 code), as V4 does."""
    if scale_format not in ("float32", "e8m0"):
        raise ValueError(f"scale_format must be 'float32' or 'e8m0', got {scale_format!r}")
    out_f, in_f = w.shape
    gr, gc = scale_grid(out_f, in_f, block)
    padded = w.float().new_zeros(gr * block, gc * block)
    padded[:out_f, :in_f] = w.float()
    blocks = padded.view(gr, block, gc, block)
    amax = blocks.abs().amax(dim=(1, 3))  # [gr, gc]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    if scale_format == "e8m0":
        stored = float_to_e8m0_ceil(scale)
        scale = e8m0_to_float(stored)
    else:
        stored = scale
    per_elem = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
    codes = (w.float() / per_elem).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, stored
