"""kernels/triton/hyper_connections.py against its twin (kernels/reference/hyper_connections.py),
the twin against the engine's torch ops (engine/ops/hyper_connections.py), and a token's
results bit for bit alone and in a batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.ops.hyper_connections import TORCH_HYPER_CONNECTION, TORCH_HYPER_HEAD
from kernels.reference.hyper_connections import (
    hc_head_reference,
    hc_post_reference,
    hc_pre_reference,
)
from kernels.triton.hyper_connections import hc_head, hc_post, hc_pre
from tests.kernels._helpers import DEVICE

# hc_eps 1e-3 (V4: 1e-6) so that where it is added (pre, the softmax, every Sinkhorn
# denominator) shows above the float32 rounding; norm_eps as V4
HC_EPS = 1e-3
EPS = 1e-6
ITERS = 20


def _weights(C: int, D: int, rows: int, scales: int, seed: int):
    """Random fn, base and scale; the comb's base is spread wide (std 2), where 20 Sinkhorn
    rounds have not converged, so a round more or less changes the comb."""
    g = torch.Generator().manual_seed(seed)
    fn = torch.randn(rows, C * D, generator=g) * 0.05
    base = torch.randn(rows, generator=g)
    base[2 * C :] *= 2
    scale = torch.rand(scales, generator=g) * 1.5 + 0.25
    return fn.to(DEVICE), base.to(DEVICE), scale.to(DEVICE)


def _streams(T: int, C: int, D: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, C, D, generator=g) * 3).to(dtype).to(DEVICE)


def _layer(fn, base, scale, C):
    """The attributes the engine's ops read from a HyperConnection / HyperHead."""
    return SimpleNamespace(
        fn=fn, base=base, scale=scale, hc_mult=C, hc_sinkhorn_iters=ITERS, hc_eps=HC_EPS,
        norm_eps=EPS,
    )  # fmt: skip


def _x_tol(dtype):
    # bf16: a couple of ulps (the interpreter truncates float32 -> bf16 instead of rounding)
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-6, atol=1e-2)


@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pre_matches_twin(T, D, dtype):
    C = 4
    fn, base, scale = _weights(C, D, (2 + C) * C, 3, seed=T + D)
    streams = _streams(T, C, D, dtype, seed=T * D)
    want = hc_pre_reference(streams, fn, base, scale, ITERS, HC_EPS, EPS)
    # several splits of K (64 per program) and one split at these sizes
    for k_per_split in (64, 512):
        x, post, comb = hc_pre(streams, fn, base, scale, ITERS, HC_EPS, EPS, k_per_split)
        assert x.dtype == dtype and post.dtype == comb.dtype == torch.float32
        torch.testing.assert_close(post, want[1], rtol=0, atol=1e-5)
        torch.testing.assert_close(comb, want[2], rtol=0, atol=1e-5)
        torch.testing.assert_close(x, want[0], **_x_tol(dtype))


@pytest.mark.parametrize(
    ("D", "k_per_split"),
    [(2560, 64), (4096, None)],  # 160 splits (a load of 128 and a part of one); V4's K: 128
)
def test_pre_adds_more_splits_than_one_load_holds(D, k_per_split):
    C, T = 4, 2
    fn, base, scale = _weights(C, D, (2 + C) * C, 3, seed=D)
    streams = _streams(T, C, D, torch.bfloat16, seed=D + 1)
    want = hc_pre_reference(streams, fn, base, scale, ITERS, HC_EPS, EPS)
    split = {} if k_per_split is None else {"k_per_split": k_per_split}
    x, post, comb = hc_pre(streams, fn, base, scale, ITERS, HC_EPS, EPS, **split)
    torch.testing.assert_close(post, want[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(comb, want[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(x, want[0], **_x_tol(torch.bfloat16))
    alone = hc_pre(streams[1:], fn, base, scale, ITERS, HC_EPS, EPS, **split)
    for got, batch in zip(alone, (x, post, comb), strict=True):
        assert torch.equal(got, batch[1:])


def test_pre_pads_three_streams_and_keeps_leading_dims():
    C, D = 3, 64  # C_PAD 4, M = 15 of a 16-wide tile
    fn, base, scale = _weights(C, D, (2 + C) * C, 3, seed=3)
    streams = _streams(6, C, D, torch.float32, seed=4).reshape(2, 3, C, D)
    x, post, comb = hc_pre(streams, fn, base, scale, ITERS, HC_EPS, EPS, 64)
    want = hc_pre_reference(streams.reshape(6, C, D), fn, base, scale, ITERS, HC_EPS, EPS)
    assert x.shape == (2, 3, D) and post.shape == (2, 3, C) and comb.shape == (2, 3, C, C)
    torch.testing.assert_close(post.reshape(6, C), want[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.reshape(6, C, C), want[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(x.reshape(6, D), want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C", [4, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_matches_twin(C, dtype):
    D, T = 64, 5
    fn, base, scale = _weights(C, D, C, 1, seed=C)
    streams = _streams(T, C, D, dtype, seed=C + 1)
    got = hc_head(streams, fn, base, scale, HC_EPS, EPS, 64)
    assert got.dtype == dtype
    torch.testing.assert_close(
        got, hc_head_reference(streams, fn, base, scale, HC_EPS, EPS), **_x_tol(dtype)
    )


def _post_inputs(T, C, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    streams = _streams(T, C, D, dtype, seed)
    y = torch.randn(T, D, generator=g).to(dtype).to(DEVICE)
    post = (2 * torch.rand(T, C, generator=g)).to(DEVICE)
    comb = torch.softmax(torch.randn(T, C, C, generator=g), dim=-1).to(DEVICE)
    return y, streams, post, comb


@pytest.mark.parametrize("T", [1, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_post_matches_twin(T, dtype):
    C, D = 4, 320  # D not a multiple of the kernel's 256 columns
    y, streams, post, comb = _post_inputs(T, C, D, dtype, seed=T)
    got = hc_post(y, streams, post, comb)
    want = hc_post_reference(y, streams, post, comb)
    assert got.dtype == dtype and got.shape == streams.shape
    if DEVICE == "cuda":  # the GPU fuses and orders the C products its own way: ulps apart
        ulp = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}[dtype]
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got, want, rtol=4 * ulp, atol=4 * ulp * scale)
    elif dtype == torch.bfloat16:  # the interpreter truncates each of the three roundings
        torch.testing.assert_close(got, want, rtol=2**-5, atol=2**-5)
    else:  # each rounding where the twin rounds, the sum in the twin's order
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_matches_the_engine_ops(dtype):
    C, D, T = 4, 64, 9  # two torch forms of the same math: compared on the CPU
    fn, base, scale = (t.cpu() for t in _weights(C, D, (2 + C) * C, 3, seed=11))
    streams = _streams(T, C, D, dtype, seed=12).cpu()
    hc = _layer(fn, base, scale, C)
    x, post, comb = TORCH_HYPER_CONNECTION.pre(hc, streams)
    want = hc_pre_reference(streams, fn, base, scale, ITERS, HC_EPS, EPS)
    torch.testing.assert_close(post, want[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(comb, want[2], rtol=0, atol=1e-5)
    torch.testing.assert_close(x, want[0], **_x_tol(dtype))
    y = torch.randn(T, D, generator=torch.Generator().manual_seed(13)).to(dtype)
    torch.testing.assert_close(
        hc_post_reference(y, streams, post, comb),
        TORCH_HYPER_CONNECTION.post(hc, y, streams, post, comb),
        rtol=1e-6, atol=1e-6,
    )  # fmt: skip
    head = _layer(*(t.cpu() for t in _weights(C, D, C, 1, seed=14)), C)
    torch.testing.assert_close(
        hc_head_reference(streams, head.fn, head.base, head.scale, HC_EPS, EPS),
        TORCH_HYPER_HEAD.forward(head, streams),
        **_x_tol(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_is_the_same_alone_and_in_a_batch(dtype):
    C, D, T = 4, 128, 17
    fn, base, scale = _weights(C, D, (2 + C) * C, 3, seed=21)
    streams = _streams(T, C, D, dtype, seed=22)
    batch = hc_pre(streams, fn, base, scale, ITERS, HC_EPS, EPS, 128)
    head_fn, head_base, head_scale = _weights(C, D, C, 1, seed=23)
    head_batch = hc_head(streams, head_fn, head_base, head_scale, HC_EPS, EPS, 128)
    y, _, post, comb = _post_inputs(T, C, D, dtype, seed=24)
    post_batch = hc_post(y, streams, post, comb)
    for t in (0, 8, 16):
        one = slice(t, t + 1)
        alone = hc_pre(streams[one], fn, base, scale, ITERS, HC_EPS, EPS, 128)
        for got, want in zip(alone, batch, strict=True):
            assert torch.equal(got, want[one])
        head_alone = hc_head(streams[one], head_fn, head_base, head_scale, HC_EPS, EPS, 128)
        assert torch.equal(head_alone, head_batch[one])
        assert torch.equal(hc_post(y[one], streams[one], post[one], comb[one]), post_batch[one])
