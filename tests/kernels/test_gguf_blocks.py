"""Block decoders against gguf-py's own dequantize, bit for bit, on fresh random blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels.cpu.gguf_blocks import dequantize_blocks, row_bytes, split_q4, split_q8_0


def random_rows(seed: int, rows: int, cols: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.01, 3.0, size=(rows, 1))  # rows of very different magnitudes
    return (rng.standard_normal((rows, cols)) * scale + rng.normal(size=(rows, 1))).astype(
        np.float32
    )


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("shape", [(1, 32), (7, 96), (48, 256)])
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_matches_gguf_py(qtype, shape, seed):
    gtype = GGMLQuantizationType[qtype]
    raw = quantize(random_rows(seed, *shape), gtype)  # uint8 [rows, row bytes]
    assert raw.shape[1] == row_bytes(qtype, shape[1])
    expected = torch.from_numpy(dequantize(raw, gtype).reshape(shape).copy())
    got = dequantize_blocks(torch.from_numpy(raw.copy()), qtype)
    assert got.dtype == torch.float32
    assert torch.equal(got, expected)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_split_q4_parts_rebuild_the_weight(qtype):
    raw = quantize(random_rows(5, 16, 64), GGMLQuantizationType[qtype])
    q, d, m = split_q4(torch.from_numpy(raw.copy()), qtype)
    assert q.shape == (16, 2, 32) and int(q.max()) <= 15
    rebuilt = (d[..., None] * q.float() + m[..., None]).reshape(16, 64)
    expected = dequantize_blocks(torch.from_numpy(raw.copy()), qtype)
    torch.testing.assert_close(rebuilt, expected, rtol=1e-6, atol=1e-6)


def test_split_q8_0_parts():
    raw = quantize(random_rows(6, 16, 64), GGMLQuantizationType.Q8_0)
    q, d = split_q8_0(torch.from_numpy(raw.copy()))
    assert q.dtype == torch.int8 and q.shape == (16, 2, 32) and d.shape == (16, 2)
    expected = dequantize_blocks(torch.from_numpy(raw.copy()), "Q8_0")
    assert torch.equal((q.float() * d[..., None]).reshape(16, 64), expected)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="Q4_1 row of 21 bytes"):
        dequantize_blocks(torch.zeros(2, 21, dtype=torch.uint8), "Q4_1")
    with pytest.raises(TypeError, match="uint8"):
        dequantize_blocks(torch.zeros(2, 20), "Q4_1")
    with pytest.raises(ValueError, match="Q5_0"):
        dequantize_blocks(torch.zeros(2, 22, dtype=torch.uint8), "Q5_0")
