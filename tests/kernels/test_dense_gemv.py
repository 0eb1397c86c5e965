import pytest
import torch

from kernels.reference.dense_gemv import dense_gemv_reference
from kernels.triton._arrival_counters import arrival_counters
from kernels.triton.dense_gemv import GEMV_MAX_M, default_config, dense_gemv
from tests.kernels._helpers import DEVICE, gpu_only, poisoned, rel_err


def _case(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    return x, w


def _close(y, x, w):
    """y within one unit in the last place of the reference (float32 product, rounded once),
    plus float32 sum-order noise: the kernel's K order differs, so a rounding may flip. A
    truncating convert also passes: the interpreter (triton 3.9) converts float32 -> bf16 by
    dropping the low bits, where the GPU rounds to nearest."""
    ref = dense_gemv_reference(x, w).double()
    bound = torch.finfo(y.dtype).eps * ref.abs() + 1e-4 * ref.abs().max()
    return bool(((y.double() - ref).abs() <= bound).all()) and rel_err(y, ref) < 1e-2


def _cfg(block_n, block_k, split_k, num_warps=4):
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=num_warps)


@pytest.mark.parametrize("m", range(1, GEMV_MAX_M + 1))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_gemv_every_decode_m(m, dtype):
    # N and K off the tiles (a partial row block, a partial K step, K not a multiple of 8).
    x, w = _case(m, 45, 203, dtype, seed=10 * m + (dtype == torch.float16))
    y = dense_gemv(x, w, config=_cfg(16, 64, 2))
    assert y.shape == (m, 45) and y.dtype == dtype
    assert _close(y, x, w)


@pytest.mark.parametrize("block_n,block_k,split_k", [(8, 32, 1), (32, 128, 3), (16, 64, 7)])
def test_dense_gemv_tiles_and_splits(block_n, block_k, split_k):
    x, w = _case(3, 70, 488, torch.bfloat16, seed=block_n + split_k)
    y = dense_gemv(x, w, config=_cfg(block_n, block_k, split_k))
    assert _close(y, x, w)


def test_dense_gemv_writes_every_output_once():
    # A NaN-filled partial buffer from the caching allocator must never leak into y: every
    # element comes from a split's own stores (N, K chosen so the last split is short).
    x, w = _case(5, 33, 136, torch.float16, seed=3)
    stale = poisoned((4, 5, 33), torch.float32)
    del stale
    y = dense_gemv(x, w, config=_cfg(16, 32, 4))
    assert not torch.isnan(y).any()
    assert _close(y, x, w)


def test_dense_gemv_split_k_is_deterministic_and_resets_counters():
    x, w = _case(4, 100, 512, torch.bfloat16, seed=5)
    cfg = _cfg(16, 64, 4)
    first = dense_gemv(x, w, config=cfg)
    # The last arriver zeroes its counter: the next call (a graph replay) starts from zero.
    assert int(arrival_counters(x.device, 7).abs().sum()) == 0
    again = dense_gemv(x, w, config=cfg)
    assert torch.equal(first, again)  # partials summed in split order, not arrival order
    assert _close(first, x, w)


def test_dense_gemv_takes_leading_dims_and_strided_rows():
    x, w = _case(6, 40, 96, torch.bfloat16, seed=8)
    y = dense_gemv(x.view(2, 3, 96), w)  # the default config
    assert y.shape == (2, 3, 40)
    assert _close(y.view(6, 40), x, w)
    wide = torch.cat([x, x], dim=1)[:, :96]  # rows 192 apart, unit column stride
    assert _close(dense_gemv(wide, w), x, w)


def test_dense_gemv_rejects_too_many_rows_and_mixed_dtypes():
    x, w = _case(GEMV_MAX_M + 1, 16, 32, torch.bfloat16, seed=1)
    with pytest.raises(AssertionError, match="at most"):
        dense_gemv(x, w)
    with pytest.raises(AssertionError, match="but weight is"):
        dense_gemv(x[:2].half(), w)


def test_dense_gemv_default_config_fills_the_gpu():
    cpu = torch.device("cpu")  # counts as 4 SMs
    # Fewer 32-row blocks than SMs: 16-row blocks, and K split for ~4 programs per SM.
    cfg = default_config(1, 40, 2048, cpu)
    assert cfg["BLOCK_N"] == 16 and cfg["SPLIT_K"] == 6
    # Enough row blocks alone: no split.
    assert default_config(8, 4096, 2048, cpu)["SPLIT_K"] == 1


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("n,k", [(3072, 2048), (576, 2048), (2048, 2048), (1000, 1040)])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("split_k", [1, 4, 16])
def test_dense_gemv_gpu_engine_shapes(n, k, m, split_k):
    x, w = _case(m, n, k, torch.bfloat16, seed=n + m + split_k)
    cfg = _cfg(32, 128, split_k)
    y = dense_gemv(x, w, config=cfg)
    assert _close(y, x, w)
    assert torch.equal(y, dense_gemv(x, w, config=cfg))
    assert _close(dense_gemv(x, w), x, w)  # default config
