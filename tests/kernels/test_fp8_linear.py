import pytest
import torch

from kernels.reference.fp8_linear import act_quant_reference, fp8_block_linear_reference
from kernels.reference.quant_formats import random_fp8_block
from kernels.triton.fp8_linear import act_quant, fp8_block_linear
from tests.kernels._helpers import DEVICE, gpu_only, rel_err


def _case(m, n, k, scale_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, s = random_fp8_block((n, k), scale_dtype=scale_dtype, generator=g, device=DEVICE)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    return x, q, s


@pytest.mark.parametrize("m,n,k", [(1, 48, 160), (5, 130, 256), (33, 64, 128)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.uint8])
def test_fp8_linear_matches_reference(m, n, k, scale_dtype):
    x, q, s = _case(m, n, k, scale_dtype, seed=m * 7 + n)
    y = fp8_block_linear(x, q, s)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < 1e-2


@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_linear_split_k_and_small_tiles(split_k):
    x, q, s = _case(3, 96, 384, torch.float32, seed=split_k)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=split_k, num_warps=4, num_stages=2)
    y = fp8_block_linear(x, q, s, config=cfg)
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < 1e-2


def test_fp8_linear_native_path_matches_quantized_reference():
    x, q, s = _case(4, 64, 256, torch.uint8, seed=11)
    xq, xs = act_quant(x)
    xq_ref, xs_ref = act_quant_reference(x)
    assert torch.allclose(xs, xs_ref, rtol=1e-6)
    assert (xq.float() - xq_ref.float()).abs().max() <= 0.0625 * xq_ref.float().abs().max()
    y = fp8_block_linear(x, q, s, native_fp8=True)
    # Activation quantization to E4M3 costs a few percent; the float path is the oracle.
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < 6e-2


def test_fp8_linear_rejects_bad_scale_shape():
    x, q, s = _case(2, 64, 256, torch.float32, seed=1)
    with pytest.raises(AssertionError, match="scale must be"):
        fp8_block_linear(x, q, s[:, :1].contiguous())


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("m", [1, 8, 64, 512])
@pytest.mark.parametrize("native", [False, True])
def test_fp8_linear_gpu_sizes(m, native):
    x, q, s = _case(m, 4096, 7168, torch.float32, seed=m)
    y = fp8_block_linear(x, q, s, native_fp8=native)
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < (6e-2 if native else 1e-2)
