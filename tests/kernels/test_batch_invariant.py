"""The CPU batch-invariant matmuls and attention: a row's bits do not depend on how many
rows, problems or padded keys share its call, and the values match the plain torch twin."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import batch_invariant, fixed_order_linear
from kernels.cpu.fixed_order_linear import fixed_order_linear_reference
from kernels.reference.attention import attention_reference

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1536, 576), (64, 48), (320, 64), (8, 16)])
def test_linear_rows_do_not_depend_on_the_call(shape, dtype):
    n, k = shape
    gen = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    x = torch.randn(140, k, generator=gen).to(dtype)
    full = batch_invariant.linear(x, w)
    for m in [*range(1, 20), 31, 64, 127, 139]:
        assert torch.equal(batch_invariant.linear(x[:m], w), full[:m]), m
    assert torch.equal(batch_invariant.linear(x[5:6], w), full[5:6])  # a row alone
    perm = torch.randperm(140, generator=gen)
    assert torch.equal(batch_invariant.linear(x[perm], w), full[perm])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    ref = x.float() @ w.float().t()
    assert torch.allclose(full.float(), ref, rtol=tol, atol=tol * ref.abs().max())


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (13, 37), (64, 48), (130, 96), (9, 16)])
def test_fixed_order_linear_is_bit_equal_to_its_torch_twin(shape, monkeypatch):
    """Every tile size (4 x 4, the row and column tails, one row), the K tail past the last
    16 lanes, one thread and several: the same bits as the order spelled out in torch."""
    n, k = shape
    gen = torch.Generator().manual_seed(n * 31 + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(2, 11, k, generator=gen)  # [..., K]
    want = fixed_order_linear_reference(x, w)
    assert torch.equal(fixed_order_linear.fixed_order_linear(x, w), want)
    monkeypatch.setattr(fixed_order_linear, "PARALLEL_MIN_WEIGHT", 0)
    assert torch.equal(fixed_order_linear.fixed_order_linear(x, w), want)
    ref = x.double() @ w.double().t()
    assert torch.allclose(want.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


def test_fixed_order_linear_takes_a_parameter_and_refuses_other_dtypes():
    w = torch.nn.Parameter(torch.randn(40, 24)[:, ::2])  # requires grad, not contiguous
    x = torch.randn(3, 12)
    assert torch.equal(
        fixed_order_linear.fixed_order_linear(x, w), fixed_order_linear_reference(x, w)
    )
    with pytest.raises(TypeError):
        fixed_order_linear.fixed_order_linear(x.bfloat16(), w.detach().bfloat16())


@pytest.mark.parametrize("shape", [(49152, 576), (576, 1536)])
def test_float32_linear_rows_do_not_depend_on_the_call_at_model_shapes(shape):
    """SmolLM2's tied head and MLP down projection: a row alone, in 2..64-row calls (on one
    thread and on several) and permuted gives the same bits."""
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=gen)
    x = torch.randn(64, k, generator=gen)
    full = batch_invariant.linear(x, w)
    for m in (1, 2, 3, 4, 5, 7, 12, 33):
        assert torch.equal(batch_invariant.linear(x[:m], w), full[:m]), m
    assert torch.equal(batch_invariant.linear(x[40:41], w), full[40:41])
    perm = torch.randperm(64, generator=gen)[:9]
    assert torch.equal(batch_invariant.linear(x[perm], w), full[perm])
    ref = x[:4].double() @ w.double().t()
    assert torch.allclose(full[:4].double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max())


def test_batched_matmul_rows_and_columns_do_not_depend_on_the_call():
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(5, 40, 24, generator=gen)
    b = torch.randn(5, 24, 50, generator=gen)
    full = batch_invariant.batched_matmul(a, b)
    for m in (1, 2, 3, 7, 13, 40):
        for n in (1, 5, 11, 50):
            got = batch_invariant.batched_matmul(a[:2, :m], b[:2, :, :n])
            assert torch.equal(got, full[:2, :m, :n]), (m, n)
    assert torch.allclose(full, torch.bmm(a, b), rtol=1e-5, atol=1e-5)


def _problem(gen, s: int, m: int, length: int, d: int = 32, e: int = 24):
    q = torch.randn(s, m, d, generator=gen)
    k = torch.randn(s, length, d, generator=gen)
    v = torch.randn(s, length, e, generator=gen)
    # causal-like visibility: row i sees keys 0..limit[i]
    limit = torch.randint(0, length, (s, m), generator=gen)
    visible = torch.arange(length)[None, None, :] <= limit[:, :, None]
    return q, k, v, visible


@pytest.mark.parametrize("length", [1, 63, 64, 65, 200, 300])
def test_attention_matches_the_torch_twin(length):
    gen = torch.Generator().manual_seed(length)
    q, k, v, visible = _problem(gen, 3, 9, length)
    got = batch_invariant.attention(q, k, v, visible, 0.17)
    want = attention_reference(q, k, v, visible, 0.17)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_attention_row_does_not_depend_on_rows_problems_or_key_padding():
    gen = torch.Generator().manual_seed(11)
    q, k, v, visible = _problem(gen, 6, 21, 200)
    full = batch_invariant.attention(q, k, v, visible, 0.2)
    # fewer problems, fewer rows, a single row
    assert torch.equal(batch_invariant.attention(q[2:3], k[2:3], v[2:3], visible[2:3], 0.2),
                       full[2:3])  # fmt: skip
    for m in (1, 2, 3, 5, 12, 20):
        got = batch_invariant.attention(q[:, :m], k, v, visible[:, :m], 0.2)
        assert torch.equal(got, full[:, :m]), m
    # the same keys padded to other lengths (as a batch's longest context pads them)
    for extra in (1, 56, 64, 120, 500):
        kp = torch.cat((k, torch.randn(6, extra, k.shape[2], generator=gen)), dim=1)
        vp = torch.cat((v, torch.randn(6, extra, v.shape[2], generator=gen)), dim=1)
        vis = torch.cat((visible, torch.zeros(6, 21, extra, dtype=torch.bool)), dim=2)
        assert torch.equal(batch_invariant.attention(q, kp, vp, vis, 0.2), full), extra


def test_attention_prefix_rows_equal_a_decode_row():
    """Query i of a causal chunk equals the same query asked alone over keys 0..i: a
    prefill chunk and a decode step give the same bits."""
    gen = torch.Generator().manual_seed(5)
    length, d = 150, 32
    q = torch.randn(1, length, d, generator=gen)
    k = torch.randn(1, length, d, generator=gen)
    v = torch.randn(1, length, d, generator=gen)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None]
    chunk = batch_invariant.attention(q, k, v, causal, 0.1)
    for i in (0, 1, 63, 64, 100, 149):
        alone = batch_invariant.attention(
            q[:, i : i + 1], k[:, : i + 1], v[:, : i + 1], causal[:, i : i + 1, : i + 1], 0.1
        )
        assert torch.equal(alone, chunk[:, i : i + 1]), i
