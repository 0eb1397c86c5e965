import pytest
import torch

from kernels.formats.e8m0 import e8m0_to_float
from kernels.formats.mxfp4 import (
    E2M1_VALUES,
    dequantize_mxfp4,
    nearest_e2m1_codes,
    pack_fp4,
    quantize_mxfp4,
    unpack_fp4,
)


def test_pack_unpack_bit_exact_with_negative_zero_and_max():
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 128), generator=gen, dtype=torch.uint8)
    codes[0, :4] = torch.tensor([8, 7, 15, 0])  # -0, +6, -6, +0
    packed = pack_fp4(codes)
    assert packed.shape == (48, 64) and packed.dtype == torch.uint8
    assert torch.equal(unpack_fp4(packed), codes)
    # low nibble is the even element
    assert packed[0, 0].item() == 8 | (7 << 4)
    assert torch.equal(unpack_fp4(packed.view(torch.int8)), codes)


def test_unpack_pack_covers_every_byte():
    every_byte = torch.arange(256, dtype=torch.uint8).view(4, 64)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)


def test_dequantize_matches_elementwise_definition():
    gen = torch.Generator().manual_seed(2)
    packed = torch.randint(0, 256, (16, 32), generator=gen, dtype=torch.uint8)
    scales = torch.randint(0, 255, (16, 2), generator=gen, dtype=torch.uint8)
    scales[0, 0], scales[1, 1] = 0, 254
    out = dequantize_mxfp4(packed, scales)
    expected = torch.empty(16, 64, dtype=torch.float64)  # overflow -> inf like float32
    for o in range(16):
        for k in range(64):
            code = (int(packed[o, k // 2]) >> (4 * (k % 2))) & 0xF
            expected[o, k] = E2M1_VALUES[code] * 2.0 ** (int(scales[o, k // 32]) - 127)
    assert torch.equal(out, expected.float())
    assert torch.equal(dequantize_mxfp4(packed, scales, 3, 9), out[3:9])


@pytest.mark.parametrize("shape", [(64, 256), (33, 96)])
def test_quantize_round_trip(shape):
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(shape, generator=gen)
    packed, scales = quantize_mxfp4(w)
    deq = dequantize_mxfp4(packed, scales)
    group_max = w.abs().view(shape[0], -1, 32).amax(-1, keepdim=True)
    # E2M1 step at the top of the range is 2 (of 6) times the scale: error <= amax / 3
    err = (deq - w).abs().view(shape[0], -1, 32)
    assert bool((err <= group_max / 3 + 1e-7).all())
    # representable values survive a second round trip exactly
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(deq)), deq)
    assert bool((e8m0_to_float(scales) * 6 >= group_max.squeeze(-1)).all())


def test_nearest_code_saturates_and_keeps_sign():
    x = torch.tensor([0.0, -0.0, 0.24, 0.26, 5.1, 7.0, -100.0])
    assert nearest_e2m1_codes(x).tolist() == [0, 8, 0, 1, 7, 7, 15]
