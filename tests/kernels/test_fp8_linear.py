import pytest
import torch

from kernels.reference.fp8_linear import (
    act_quant_reference,
    fp8_block_linear_reference,
    fp8_gemv_rmsnorm_reference,
)
from kernels.reference.quant_formats import random_fp8_block
from kernels.triton._arrival_counters import arrival_counters
from kernels.triton.fp8_linear import act_quant, default_config, fp8_block_linear
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


def _gemv(block_n, block_k, split_k, bit_decode, vec=16):
    return dict(KERNEL="gemv", BLOCK_N=block_n, BLOCK_K=block_k, VEC=vec, SPLIT_K=split_k,
                BIT_DECODE=bit_decode, num_warps=4)  # fmt: skip


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8])
def test_fp8_gemv_every_decode_m(m):
    # N and K off the 128 block (partial scale blocks, partial tiles); K a multiple of 16.
    x, q, s = _case(m, 150, 272, torch.float32, seed=100 + m)
    y = fp8_block_linear(x, q, s, config=_gemv(32, 64, 2, False))
    assert y.shape == (m, 150) and y.dtype == torch.bfloat16
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < 1e-2


@pytest.mark.parametrize("bit_decode", [False, True])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.uint8])
@pytest.mark.parametrize("split_k,block_k,vec", [(1, 128, 16), (3, 32, 16), (5, 64, 32)])
def test_fp8_gemv_decodes_splits_and_scales(bit_decode, scale_dtype, split_k, block_k, vec):
    x, q, s = _case(3, 136, 400, scale_dtype, seed=split_k * 13 + block_k)
    y = fp8_block_linear(x, q, s, config=_gemv(16, block_k, split_k, bit_decode, vec))
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < 1e-2


@pytest.mark.parametrize("m", [1, 3])
def test_fp8_gemv_whole_k_in_one_step(m):
    # The tuner's single-step tiles (8 rows, all of K at once): a tile wider than K, masked
    # past it, and the prefetch of the next step reloading the only one.
    x, q, s = _case(m, 24, 272, torch.float32, seed=40 + m)
    y = fp8_block_linear(x, q, s, config=_gemv(8, 512, 1, False))
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < 1e-2


def test_fp8_gemv_bit_decode_covers_every_code():
    # All 254 finite E4M3 codes (subnormals, zero, both signs) at each of the 16 byte
    # places of a VEC load: the integer decode must equal the format's value for each, not
    # only for typical weights. Row n holds code (n + k) % 254 at column k, so the rows of
    # x, one-hot on columns 0..7 and then 8..15, read every code at every place.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]  # [254]
    n, k = len(finite), 128
    place = (torch.arange(n)[:, None] + torch.arange(k)[None, :]) % n  # [254, 128]
    q = finite[place].view(torch.float8_e4m3fn).contiguous().to(DEVICE)  # [254, 128]
    s = torch.full((2, 1), 0.5, dtype=torch.float32, device=DEVICE)
    for first in (0, 8):
        x = torch.eye(k, dtype=torch.bfloat16, device=DEVICE)[first : first + 8]
        y = fp8_block_linear(x, q, s, config=_gemv(16, 128, 1, True))
        assert torch.equal(y.float(), fp8_block_linear_reference(x, q, s).float()), first
        assert torch.equal(y.float().cpu(), (q.float().cpu() * 0.5).T[first : first + 8])


def test_fp8_gemv_split_k_one_launch_is_deterministic_and_resets_counters():
    x, q, s = _case(4, 200, 512, torch.uint8, seed=5)
    cfg = _gemv(32, 64, 4, False)
    first = fp8_block_linear(x, q, s, config=cfg)
    # The last arriver zeroes its counter: the next call (a graph replay) starts from zero.
    assert int(arrival_counters(x.device, 7).abs().sum()) == 0
    again = fp8_block_linear(x, q, s, config=cfg)
    assert torch.equal(first, again)  # partials summed in split order, not arrival order
    assert rel_err(first, fp8_block_linear_reference(x, q, s)) < 1e-2


def test_fp8_linear_default_path_by_m():
    cpu = torch.device("cpu")
    assert default_config(1, 3072, 2048, cpu)["KERNEL"] == "gemv"
    assert default_config(2, 3072, 2048, cpu)["KERNEL"] == "dot"  # measured slower from M=2
    assert default_config(1, 18432, 7168, cpu)["KERNEL"] == "dot"  # and on large matrices
    assert default_config(9, 3072, 2048, cpu)["KERNEL"] == "dot"
    assert default_config(1, 3072, 2048, cpu, native_fp8=True)["KERNEL"] == "dot"
    # The engine's call (no config) takes the default and matches the reference.
    x, q, s = _case(2, 96, 208, torch.float32, seed=9)
    assert rel_err(fp8_block_linear(x, q, s), fp8_block_linear_reference(x, q, s)) < 1e-2


@pytest.mark.parametrize("split_k", [1, 3])
def test_fp8_linear_split_k_and_small_tiles(split_k):
    x, q, s = _case(3, 96, 384, torch.float32, seed=split_k)
    cfg = dict(
        KERNEL="dot", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, SPLIT_K=split_k, num_warps=4,
        num_stages=2,
    )  # fmt: skip
    y = fp8_block_linear(x, q, s, config=cfg)
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < 1e-2


@pytest.mark.parametrize("m,block_m,split_k", [(3, 16, 1), (40, 32, 2)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.uint8])
@pytest.mark.parametrize("native", [False, True])
def test_fp8_linear_swap_ab(m, block_m, split_k, scale_dtype, native):
    # weights as the MMA's row side: N = 200 leaves a partial row tile, M = 40 a partial
    # token tile, K = 320 a partial last step and a split with fewer steps
    x, q, s = _case(m, 200, 320, scale_dtype, seed=m)
    cfg = dict(KERNEL="dot", BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, SPLIT_K=split_k,
               SWAP_AB=True, num_warps=4, num_stages=2)  # fmt: skip
    y = fp8_block_linear(x, q, s, native_fp8=native, config=cfg)
    if native:  # the same quantized activations through the A @ W^T tile
        plain = dict(cfg, SWAP_AB=False)
        assert rel_err(y, fp8_block_linear(x, q, s, native_fp8=True, config=plain)) < 5e-3
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < (6e-2 if native else 1e-2)


@pytest.mark.parametrize("m,k", [(1, 256), (20, 200), (37, 384)])
def test_act_quant_row_tiles_match_reference(m, k):
    # 16-row programs: a partial last row tile (20, 37 rows) and a partial last K block
    x, _, _ = _case(m, 8, k, torch.float32, seed=m + k)
    x = x * torch.linspace(0.01, 100, m, device=x.device)[:, None].to(x.dtype)  # row scales
    xq, xs = act_quant(x)
    xq_ref, xs_ref = act_quant_reference(x)
    torch.testing.assert_close(xs, xs_ref, rtol=1e-6, atol=0)
    assert torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))


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
@pytest.mark.parametrize("m", [1, 3, 8, 64, 512])
@pytest.mark.parametrize("native", [False, True])
def test_fp8_linear_gpu_sizes(m, native):
    x, q, s = _case(m, 4096, 7168, torch.float32, seed=m)
    y = fp8_block_linear(x, q, s, native_fp8=native)
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < (6e-2 if native else 1e-2)
    swap = dict(KERNEL="dot", BLOCK_M=min(128, max(16, m)), BLOCK_N=64, BLOCK_K=128,
                SPLIT_K=1, SWAP_AB=True, num_warps=4, num_stages=3)  # fmt: skip
    y = fp8_block_linear(x, q, s, native_fp8=native, config=swap)
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < (6e-2 if native else 1e-2)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("n,k", [(576, 2048), (2048, 11264), (22528, 2048), (1000, 1040)])
@pytest.mark.parametrize("split_k,bit_decode", [(1, False), (4, True), (8, False)])
def test_fp8_gemv_gpu_engine_shapes(n, k, split_k, bit_decode):
    x, q, s = _case(8, n, k, torch.uint8, seed=n + split_k)
    y = fp8_block_linear(x, q, s, config=_gemv(32, 256, split_k, bit_decode))
    assert rel_err(y, fp8_block_linear_reference(x, q, s)) < 1e-2
    assert torch.equal(y, fp8_block_linear(x, q, s, config=_gemv(32, 256, split_k, bit_decode)))


def test_fp8_gemv_checks_its_input_width():
    from kernels.triton.fp8_linear import fp8_gemv

    g = torch.Generator().manual_seed(5)
    q, s = random_fp8_block((64, 128), generator=g, device=DEVICE)
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(AssertionError, match="256 columns"):
        fp8_gemv(x, q, s, _gemv(32, 64, 1, False))


@pytest.mark.parametrize(
    "m,split_k,x_dtype,scale_dtype,bit_decode",
    [
        (1, 1, torch.float32, torch.float32, False),
        (2, 4, torch.float32, torch.uint8, True),
        (8, 3, torch.bfloat16, torch.float32, True),
    ],
)
def test_fp8_gemv_rmsnorm_matches_its_torch_twin(m, split_k, x_dtype, scale_dtype, bit_decode):
    # RMSNorm(x + residual) @ dequant(W)^T and the new residual, against the plain torch
    # norm then float32 matmul. N = 150 and K = 272: partial scale blocks and tiles.
    from kernels.triton.fp8_linear import fp8_gemv_rmsnorm

    n, k = 150, 272
    g = torch.Generator().manual_seed(900 + m * 10 + split_k)
    q, s = random_fp8_block((n, k), scale_dtype=scale_dtype, generator=g, device=DEVICE)
    x = (torch.randn(m, k, generator=g) * 3).to(x_dtype).to(DEVICE)
    residual = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    want, want_res = fp8_gemv_rmsnorm_reference(x, residual, norm_w, 1e-6, q, s)
    got, got_res = fp8_gemv_rmsnorm(x, residual, norm_w, 1e-6, q, s,
                                    _gemv(32, 64, split_k, bit_decode))  # fmt: skip
    assert got.shape == (m, n) and got.dtype == got_res.dtype == torch.bfloat16
    if DEVICE == "cuda":  # the interpreter truncates float32 -> bf16 instead of rounding
        assert torch.equal(got_res, want_res)
    assert rel_err(got_res, want_res) < 1e-2
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("m,split_k", [(1, 1), (1, 4), (3, 2), (8, 3)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_fp8_gemv_rmsnorm_equals_the_norm_then_the_gemv(m, split_k, x_dtype):
    # One launch for RMSNorm(x + residual) @ W^T (each program computes its rows' rms) and
    # the new residual, against kernels/triton/rmsnorm.py then the GEMV: the residual bit
    # for bit, the product within float32 rounding (the rms sums in another order).
    from kernels.triton.fp8_linear import fp8_gemv, fp8_gemv_rmsnorm
    from kernels.triton.rmsnorm import rmsnorm

    n, k = 150, 272
    g = torch.Generator().manual_seed(400 + m * 10 + split_k)
    q, s = random_fp8_block((n, k), generator=g, device=DEVICE)
    x = (torch.randn(m, k, generator=g) * 3).to(x_dtype).to(DEVICE)
    residual = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    norm_w = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).to(DEVICE)
    cfg = _gemv(32, 64, split_k, False)
    normed, want_res = rmsnorm(x, norm_w, 1e-6, residual)
    want = fp8_gemv(normed, q, s, cfg)
    got, got_res = fp8_gemv_rmsnorm(x, residual, norm_w, 1e-6, q, s, cfg)
    assert torch.equal(got_res, want_res) and got_res.data_ptr() != residual.data_ptr()
    assert got.dtype == torch.bfloat16 and rel_err(got, want) < 2e-3
