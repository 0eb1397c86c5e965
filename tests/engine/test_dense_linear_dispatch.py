"""The CUDA backend's dense linear (engine/backends/cuda.py `dense_linear`, what
Unquantized.apply calls for CUDA bf16/fp16 inputs) on the CPU through Triton's interpreter:
<= 8 rows of bf16/fp16 weights take the GEMV kernel, anything else stays F.linear."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest
import torch.nn.functional as F

from engine.backends import cuda as backend
from engine.layers.linear import Linear
from kernels.triton.dense_gemv import GEMV_MAX_M, dense_gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_rows_take_the_gemv(dtype):
    w = _weight(24, 80, dtype, seed=1)  # K = 80: a multiple of 16, the GEMV takes it
    x = torch.randn(2, 3, 80).to(dtype).to(DEVICE)  # 6 rows in two leading dims
    y = backend.dense_linear(x, w)
    assert y.shape == (2, 3, 24) and y.dtype == dtype
    assert torch.equal(y, dense_gemv(x, w))
    assert torch.allclose(y.float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)


def test_more_rows_and_float32_stay_on_f_linear():
    w = _weight(24, 80, torch.bfloat16, seed=2)
    x = torch.randn(GEMV_MAX_M + 1, 80).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(backend.dense_linear(x, w), F.linear(x, w))
    w_odd = _weight(24, 72, torch.bfloat16, seed=4)  # K % 16 != 0: no aligned 16-byte loads
    x_odd = torch.randn(2, 72).to(torch.bfloat16).to(DEVICE)
    assert torch.equal(backend.dense_linear(x_odd, w_odd), F.linear(x_odd, w_odd))
    w32 = _weight(24, 80, torch.float32, seed=3)
    x16 = x[:2]
    # A float32 weight (exactness tests): the input is cast up and the result back, as before.
    assert torch.equal(backend.dense_linear(x16, w32), F.linear(x16.float(), w32).to(x16.dtype))


def test_linear_layer_on_cpu_is_unchanged():
    # The CPU path never reaches the backend: exactly F.linear, bias added by the layer.
    layer = Linear(16, 8, bias=True, params_dtype=torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight) + layer.bias)
