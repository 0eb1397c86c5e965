"""The fixed-configuration matmul: equal to its torch twin, and a row's result bit for bit
the same whatever other rows it is computed with (the reason it exists)."""

import pytest
import torch

from kernels.reference.matmul import fixed_bmm_reference, fixed_linear_reference
from kernels.triton.matmul import LARGE_M, fixed_bmm, fixed_config, fixed_linear, launch_config
from tests.kernels._helpers import DEVICE, rel_err

TOL = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (5, 130, 300), (70, 64, 64)])
def test_fixed_linear_matches_torch(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    got = fixed_linear(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    assert rel_err(got, fixed_linear_reference(x, w)) < TOL[dtype]


def test_fixed_linear_takes_leading_dims_and_an_out_dtype():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 48, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(20, 48, generator=gen).to(DEVICE, torch.bfloat16)
    got = fixed_linear(x, w, out_dtype=torch.float32)
    assert got.shape == (2, 3, 20) and got.dtype == torch.float32
    assert rel_err(got, fixed_linear_reference(x, w, torch.float32)) < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fixed_bmm_matches_torch_on_strided_operands(dtype):
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(6, 3, 32, generator=gen).to(DEVICE, dtype).transpose(0, 1)  # [3, 6, 32]
    b = torch.randn(3, 32, 24, generator=gen).to(DEVICE, dtype)
    got = fixed_bmm(a, b)
    assert got.shape == (3, 6, 24)
    assert rel_err(got, fixed_bmm_reference(a, b)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_does_not_depend_on_its_batch(dtype):
    # K long enough to be split, so the split partials' in-order sum is exercised too.
    n, k = 24, 1024
    assert fixed_config(n, k, dtype, torch.device(DEVICE))["SPLIT_K"] > 1
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(70, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    alone = fixed_linear(rows[:1], w)
    for m in (2, 7, 16, 64, 70):
        assert torch.equal(fixed_linear(rows[:m], w)[:1], alone), f"row 0 changed at M={m}"
    shuffled = fixed_linear(rows.flip(0), w)
    assert torch.equal(shuffled[-1:], alone)


def test_large_row_counts_sum_their_splits_in_the_program_with_the_same_bits():
    # From LARGE_M rows the tiles grow and each program adds its K splits itself: a row
    # keeps the bits it has alone (split partials summed by split_sum_kernel).
    n, k, dtype = 40, 1024, torch.bfloat16
    cfg = fixed_config(n, k, dtype, torch.device(DEVICE))
    assert cfg["SPLIT_K"] > 1 and launch_config(cfg, LARGE_M, dtype)["INLINE"] == 1
    gen = torch.Generator().manual_seed(12)
    rows = torch.randn(LARGE_M + 5, k, generator=gen).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    many = fixed_linear(rows, w)
    for r in (0, 130, LARGE_M + 4):
        assert torch.equal(many[r : r + 1], fixed_linear(rows[r : r + 1], w)), f"row {r}"
    assert rel_err(many, fixed_linear_reference(rows, w)) < TOL[dtype]


def test_empty_input():
    w = torch.randn(8, 16, device=DEVICE)
    assert fixed_linear(torch.empty(0, 16, device=DEVICE), w).shape == (0, 8)
