import pytest
import torch

from kernels.formats.e8m0 import check_e8m0, e8m0_to_float, float_to_e8m0_ceil
from kernels.formats.fp8 import (
    FP8_DTYPE,
    bits_to_fp8,
    dequantize_fp8_block,
    fp8_to_bits,
    quantize_fp8_block,
    scale_grid,
)


def test_fp8_bits_round_trip_all_codes_including_negative_zero_and_max():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (64, 96), generator=gen, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7F / 0xFF are NaN in E4M3FN
    edge = torch.tensor([0x00, 0x80, 0x7E, 0xFE, 0x01, 0x81], dtype=torch.uint8)
    codes = torch.cat((codes, edge))
    values = bits_to_fp8(codes)
    assert torch.equal(fp8_to_bits(values), codes)
    floats = values.float()
    assert floats[-6:-4].tolist() == [0.0, 0.0] and torch.signbit(floats[-5])
    assert floats[-4].item() == 448.0 and floats[-3].item() == -448.0
    # through float32 and back is exact for every finite code
    assert torch.equal(fp8_to_bits(floats.to(FP8_DTYPE)), codes)


@pytest.mark.parametrize("shape", [(256, 384), (200, 70), (129, 257)])
@pytest.mark.parametrize("scale_format", ["float32", "e8m0"])
def test_fp8_block_quantize_dequantize(shape, scale_format):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 3
    codes, scale = quantize_fp8_block(w, scale_format)
    assert codes.dtype == FP8_DTYPE
    assert tuple(scale.shape) == scale_grid(*shape)
    assert scale.dtype == (torch.float32 if scale_format == "float32" else torch.uint8)
    deq = dequantize_fp8_block(codes, scale)
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 of the block max per element
    assert (deq - w).abs().max() <= w.abs().max() * 2**-4
    # a row slice equals the same rows of the full dequantization (tiling is exact)
    lo, hi = shape[0] // 3, shape[0] - 5
    assert torch.equal(dequantize_fp8_block(codes, scale, lo, hi), deq[lo:hi])
    # reference: element-wise with explicit block indices
    rows = torch.arange(shape[0])[:, None] // 128
    cols = torch.arange(shape[1])[None, :] // 128
    s = scale.float() if scale_format == "float32" else e8m0_to_float(scale)
    assert torch.equal(deq, codes.float() * s[rows, cols])


def test_e8m0_edge_values():
    codes = torch.tensor([0, 1, 127, 128, 254], dtype=torch.uint8)
    values = e8m0_to_float(codes)
    assert values.tolist() == [2.0**-127, 2.0**-126, 1.0, 2.0, 2.0**127]
    assert torch.equal(float_to_e8m0_ceil(values), codes)
    as_e8m0 = codes.view(torch.float8_e8m0fnu)
    assert torch.equal(e8m0_to_float(as_e8m0), values)
    check_e8m0(codes, "ok.scale")


def test_e8m0_nan_rejected_naming_tensor():
    codes = torch.tensor([[1, 2], [255, 3]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"layers\.0\.w1\.scale.*255.*\(1, 0\)"):
        check_e8m0(codes, "layers.0.w1.scale")
