"""V4 attention's q / kv prologue and o epilogue kernels (kernels/triton/v4_qkv.py) against
the engine's torch functions (engine/ops/v4_attention.py, the CPU norm) and the torch twin
(kernels/reference/v4_qkv.py): float32 to 1e-5, bf16 to bf16's rounding (the interpreter
truncates float32 -> bf16 where torch rounds). Positions reach 70000, so the angles of the
fastest pair are large."""

from __future__ import annotations

import pytest
import torch

from engine.layers.norm import RMSNorm
from engine.ops.v4_attention import apply_rope, grouped_low_rank, rope_cos_sin, unit_rms
from kernels.reference.v4_qkv import (
    v4_kv_prologue_reference,
    v4_o_epilogue_reference,
    v4_q_prologue_reference,
)
from kernels.triton.v4_qkv import v4_kv_prologue, v4_o_epilogue, v4_q_prologue
from tests.kernels._helpers import DEVICE, gpu_only, poisoned, rel_err

EPS = 1e-6
# (rows, heads, head_dim, rope dims): a head_dim off the powers of two, a rope over the
# whole head, and V4-Flash's shapes (GPU only)
TINY = [(3, 4, 24, 8), (2, 2, 16, 16)]
FLASH = (5, 64, 512, 64)


def inv_freq_for(rope_dims: int) -> torch.Tensor:
    return 1e4 ** -(torch.arange(0, rope_dims, 2, dtype=torch.float32) / rope_dims)


def case(rows, heads, head_dim, rope_dims, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, heads * head_dim, generator=g)).to(dtype)
    positions = torch.randint(0, 70000, (rows,), generator=g)
    return x.to(DEVICE), positions.to(DEVICE), inv_freq_for(rope_dims).to(DEVICE), g


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        assert rel_err(out, ref) < 1e-2


def engine_query(x, positions, inv_freq, heads):
    cos, sin = rope_cos_sin(positions, inv_freq)
    return apply_rope(unit_rms(x.view(x.shape[0], heads, -1), EPS), cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", TINY + [pytest.param(FLASH, marks=gpu_only)])
def test_q_prologue_matches_the_engines_unit_rms_and_rope(shape, dtype):
    rows, heads, head_dim, rope_dims = shape
    x, positions, inv_freq, _ = case(*shape, dtype, seed=head_dim)
    q = v4_q_prologue(x, positions, inv_freq, EPS, heads)
    assert_close(q, engine_query(x, positions, inv_freq, heads), dtype)
    assert_close(q, v4_q_prologue_reference(x, positions, inv_freq, EPS, heads), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", TINY + [pytest.param(FLASH, marks=gpu_only)])
def test_kv_prologue_matches_kv_norm_and_rope_and_writes_only_its_ring_rows(shape, dtype):
    rows, _, head_dim, rope_dims = shape
    x, positions, inv_freq, g = case(rows, 1, head_dim, rope_dims, dtype, seed=head_dim + 1)
    norm = RMSNorm(head_dim, EPS)
    norm.weight.data = (1 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype)
    ring_size = 7
    slots = torch.randperm(rows + 2, generator=g)[:rows].to(DEVICE)
    ring = poisoned((rows + 2, ring_size, head_dim), dtype)
    kv = v4_kv_prologue(x, norm.weight.to(DEVICE), EPS, positions, inv_freq, ring, slots)
    norm = norm.to(DEVICE)
    cos, sin = rope_cos_sin(positions, inv_freq)
    assert_close(kv, apply_rope(norm(x), cos, sin), dtype)
    ring_ref = poisoned(ring.shape, dtype)
    kv_ref = v4_kv_prologue_reference(x, norm.weight, EPS, positions, inv_freq, ring_ref, slots)
    assert_close(kv, kv_ref, dtype)
    assert torch.equal(ring.isnan(), ring_ref.isnan())  # the rows' own ring rows, no others
    assert torch.equal(ring[slots, positions % ring_size], kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("o_groups", [1, 2])
@pytest.mark.parametrize("shape", TINY + [pytest.param(FLASH, marks=gpu_only)])
def test_o_epilogue_matches_the_derotation_and_grouped_low_rank(shape, o_groups, dtype):
    rows, heads, head_dim, rope_dims = shape
    o_groups = 8 if heads == 64 else o_groups
    rank = 1024 if heads == 64 else 6
    x, positions, inv_freq, g = case(*shape, dtype, seed=head_dim + o_groups)
    o = x.view(rows, heads, head_dim)
    width = heads * head_dim // o_groups
    wo_a = (torch.randn(o_groups * rank, width, generator=g) * width**-0.5).to(dtype)
    wo_a = wo_a.to(DEVICE)
    out = v4_o_epilogue(o, positions, inv_freq, wo_a)
    cos, sin = rope_cos_sin(positions, inv_freq)
    assert_close(out, grouped_low_rank(apply_rope(o, cos, -sin), wo_a), dtype)
    assert_close(out, v4_o_epilogue_reference(o, positions, inv_freq, wo_a), dtype)
