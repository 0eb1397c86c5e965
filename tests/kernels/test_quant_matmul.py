"""The int4 CPU kernel wrapper against its float32 torch twin on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.quant_matmul import (
    Int4Weight,
    int4_dequantize,
    int4_kernel_available,
    int4_matmul,
    int4_matmul_reference,
    int8_groups_as_int4,
)

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="no int4 CPU kernel")


def random_int4(seed: int, n: int, k: int, gs: int = 32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // gs, generator=g) * 0.1 + 0.01
    zero = torch.randn(n, k // gs, generator=g) * 0.1
    # the kernel keeps scales in bfloat16; give the twin the same scales
    return q, scale.bfloat16().float(), zero.bfloat16().float()


@pytest.mark.parametrize("n,k", [(16, 32), (48, 96), (192, 576)])
@pytest.mark.parametrize("m", [1, 3, 17, 130])  # 130: the decode-to-bf16 path
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matmul_matches_reference(n, k, m, dtype):
    q, scale, zero = random_int4(n * k + m, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    w = Int4Weight.pack(q, scale, zero)
    got = int4_matmul(x, w)
    assert got.dtype == dtype and got.shape == (m, n)
    # activations are rounded to bfloat16 inside: compare at bfloat16 precision
    want = int4_matmul_reference(x.bfloat16().float(), q, scale, zero)
    scale_of_sum = (x.float().abs() @ int4_dequantize(w).abs().t()).clamp_min(1e-3)
    assert ((got.float() - want.float()).abs() / scale_of_sum).max() < 2**-7


def test_int4_dequantize_is_exact_and_batched_shapes_work():
    q, scale, zero = random_int4(7, 32, 64)
    w = Int4Weight.pack(q, scale, zero)
    want = ((q.float() - 8).reshape(32, 2, 32) * scale[..., None] + zero[..., None]).reshape(32, 64)
    assert torch.equal(int4_dequantize(w), want)
    x = torch.randn(2, 3, 64)
    assert int4_matmul(x, w).shape == (2, 3, 32)


def test_int8_groups_as_int4_rebuilds_int8_blocks():
    g = torch.Generator().manual_seed(11)
    q8 = torch.randint(-128, 128, (32, 3, 32), generator=g, dtype=torch.int16).to(torch.int8)
    d = torch.rand(32, 3, generator=g) + 0.1
    q4, scale, zero = int8_groups_as_int4(q8, d)
    assert q4.shape == (32, 192) and int(q4.max()) <= 15
    w = (q4.float() - 8).reshape(32, 6, 32) * scale[..., None] + zero[..., None]  # [N, 2G, 32]
    hi, lo = w.reshape(32, 192).chunk(2, dim=1)
    # exact in real arithmetic; float32 rounds the three products and two sums
    torch.testing.assert_close(
        hi + lo, (q8.float() * d[..., None]).reshape(32, 96), rtol=1e-6, atol=1e-5
    )


def test_shapes_the_kernel_cannot_take_are_refused():
    q, scale, zero = random_int4(1, 8, 32)
    with pytest.raises(ValueError, match="out_features % 16"):
        Int4Weight.pack(q, scale, zero)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    q, scale, zero = random_int4(5, 192, 576)
    w = Int4Weight.pack(q, scale, zero)
    x = torch.randn(300, 576, generator=torch.Generator().manual_seed(6))
    full = int4_matmul(x, w)
    for m in (1, 2, 3, 7, 64, 127, 128, 129, 299):
        assert torch.equal(int4_matmul(x[:m], w), full[:m]), m
