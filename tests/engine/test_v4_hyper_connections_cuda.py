"""The CUDA backend's hyper-connection ops (engine/backends/cuda/hyper_connections.py) against
the torch ops on the same layers: what a model prepared for CUDA gets, the kernels' results
for bf16 streams, and the torch fallback for float32 streams (on the CPU through Triton's
interpreter, on a GPU for real)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.backends.cuda.hyper_connections import CudaHyperConnectionOps, CudaHyperHeadOps
from engine.backends.prepare import prepare_model
from engine.layers.hyper_connections import HyperConnection, HyperHead
from engine.ops.device_layer import DeviceSetup
from engine.ops.hyper_connections import TORCH_HYPER_CONNECTION, TORCH_HYPER_HEAD
from tests.kernels._helpers import DEVICE

C, D, T = 4, 128, 7


@pytest.fixture(scope="module")
def layers():
    hc = HyperConnection(D, C, 20, 1e-6, 1e-6, "hc_attn", "layers.0.")
    head = HyperHead(D, C, 1e-6, 1e-6)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in (hc, head):
            module.fn.copy_(torch.randn(module.fn.shape, generator=g) * 0.05)
            module.base.copy_(torch.randn(module.base.shape, generator=g))
            module.scale.copy_(torch.rand(module.scale.shape, generator=g) + 0.25)
    model = nn.ModuleList([hc, head]).to(DEVICE)
    # the CUDA backend's ops, for tensors that stay on the CPU under the interpreter
    prepare_model(model, DeviceSetup(torch.device("cuda"), torch.bfloat16, 64))
    return hc, head


def _streams(dtype, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, C, D, generator=g) * 3).to(dtype).to(DEVICE)


def test_a_model_prepared_for_cuda_takes_the_cuda_ops(layers):
    hc, head = layers
    assert isinstance(hc.ops, CudaHyperConnectionOps)
    assert isinstance(head.ops, CudaHyperHeadOps)


def test_bf16_streams_take_the_kernels_and_match_the_torch_ops(layers):
    hc, head = layers
    streams = _streams(torch.bfloat16)
    y = torch.randn(T, D, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEVICE)
    x, post, comb = hc.pre(streams)
    x_ref, post_ref, comb_ref = TORCH_HYPER_CONNECTION.pre(hc, streams)
    assert x.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    torch.testing.assert_close(post, post_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(comb, comb_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(x, x_ref, rtol=2**-6, atol=1e-2)
    out = hc.post(y, streams, post_ref, comb_ref)  # the same coefficients as the torch op's
    want = TORCH_HYPER_CONNECTION.post(hc, y, streams, post_ref, comb_ref)
    torch.testing.assert_close(out, want, rtol=2**-5, atol=2**-5)
    torch.testing.assert_close(head(streams), TORCH_HYPER_HEAD.forward(head, streams),
                               rtol=2**-6, atol=1e-2)  # fmt: skip


def test_streams_with_a_gap_between_tokens_rows(layers):
    # a [T, C, D] view of wider rows: the ops copy it into the kernels' layout
    hc, head = layers
    wide = _streams(torch.bfloat16, seed=3).repeat(1, 1, 2)  # [T, C, 2D]
    streams = wide[..., :D]
    assert streams.stride(-2) != D
    x, post, comb = hc.pre(streams)
    x_ref, post_ref, comb_ref = TORCH_HYPER_CONNECTION.pre(hc, streams)
    torch.testing.assert_close(comb, comb_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(x, x_ref, rtol=2**-6, atol=1e-2)
    torch.testing.assert_close(
        hc.post(x, streams, post, comb),
        TORCH_HYPER_CONNECTION.post(hc, x, streams, post, comb),
        rtol=2**-5, atol=2**-5,
    )  # fmt: skip


def test_float32_streams_keep_the_torch_ops_bit_for_bit(layers):
    hc, head = layers
    streams = _streams(torch.float32, seed=4)
    y = torch.randn(T, D, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    got = hc(streams, lambda x: y)
    x, post, comb = TORCH_HYPER_CONNECTION.pre(hc, streams)
    assert torch.equal(got, TORCH_HYPER_CONNECTION.post(hc, y, streams, post, comb))
    assert torch.equal(head(streams), TORCH_HYPER_HEAD.forward(head, streams))
