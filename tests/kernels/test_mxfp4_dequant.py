import pytest
import torch

from kernels.reference.quant_formats import dequant_mxfp4 as dequant_reference
from kernels.triton.mxfp4_dequant import dequant_mxfp4
from tests.kernels._helpers import DEVICE, gpu_only


def _codes(shape, seed, lowest_scale=100):
    """Every nibble pattern; scales 2^(lowest_scale - 127) .. 2^1 (the engine admits up to
    2^1). The interpreter casts float32 to bf16 with subnormals flushed, so its cases keep
    products normal; the GPU case takes the whole range from 2^-127."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    codes = torch.randint(0, 256, (*lead, n, k // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(lowest_scale, 129, (*lead, n, k // 32), generator=g,
                           dtype=torch.uint8)  # fmt: skip
    return codes.to(DEVICE), scales.to(DEVICE)


@pytest.mark.parametrize("shape", [(3, 5, 96), (2, 17, 1056), (40, 64)])
def test_dequant_mxfp4_equals_the_reference_bit_for_bit(shape):
    # 17 rows: a partial row tile; K/2 = 528 bytes: a second, partial byte tile
    codes, scales = _codes(shape, seed=sum(shape))
    out = dequant_mxfp4(codes, scales)
    want = dequant_reference(codes, scales).to(torch.bfloat16)
    assert out.shape == want.shape and out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_dequant_mxfp4_rejects_a_scale_grid_of_another_shape():
    codes, scales = _codes((4, 64), seed=1)
    with pytest.raises(AssertionError, match="scales must be"):
        dequant_mxfp4(codes, scales[:, :1].contiguous())


@pytest.mark.gpu
@gpu_only
def test_dequant_mxfp4_gpu_moonlight_experts():
    # the stacked gate+up of 64 Moonlight experts, through the PTX decode
    codes, scales = _codes((64, 2816, 2048), seed=3, lowest_scale=0)
    out = dequant_mxfp4(codes, scales)
    want = dequant_reference(codes, scales).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
