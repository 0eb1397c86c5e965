"""DeepSeek-V4 attention's per-token prologue and epilogue on a decode step, one launch each
where the torch ops take a dozen (cos/sin, norms, the rope's slicing, stacking and casts):

- `v4_q_prologue`: wq_b's output [B, H * head_dim] -> per-head unit RMS (no weight), rope
  on the last P dims -> q [B, H, head_dim];
- `v4_kv_prologue`: wkv's output [B, head_dim] -> kv_norm (RMSNorm with its weight), rope
  -> kv [B, head_dim], also written into the window ring [slots, ring_size, head_dim] at
  [slot, pos % ring_size];
- `v4_o_epilogue`: the attention's o [B, H, head_dim] -> de-rotation (rope at -pos) into
  the [o_groups, B, H * head_dim / o_groups] layout of the grouped wo_a, then one batched
  matmul whose output lands in [B, o_groups * o_lora_rank] as wo_b reads it (no copy).

The arithmetic is engine/ops/v4_attention.py's (`rope_cos_sin`, `apply_rope`, `unit_rms`,
`grouped_low_rank`) and the rmsnorm kernel's: cos/sin of pos * inv_freq in float32; the
unit RMS scale in float32, rounded to the model dtype before the product; kv_norm's
x * rstd * w in float32, rounded; the rope on the rounded values in float32, rounded. So
the results agree with the torch ops to one rounding of the model dtype. Torch twin:
kernels/reference/v4_qkv.py; kernel bodies: _v4_qkv_kernels.py. Legend: docs/shapes.md
(B rows, H heads, P rope dims); positions [B] int, inv_freq [P/2] float32.

Floor per row and layer at V4-Flash (H 64, head_dim 512, bf16): q reads and writes
64 * 512 * 2 = 64 KiB each; kv reads 1 KiB (and the 1 KiB weight once per step) and
writes 1 KiB twice (kv and the ring); the de-rotation reads and writes 64 KiB. The
grouped wo_a reads its whole weight, 8 * 1024 * 4096 * 2 = 64 MiB per step whatever B
is (~14 us at the H200's 4.8 TB/s): that read, not the 64 KiB per row, is what the
epilogue's floor is at small batches, so the de-rotation stays a separate launch
beside cuBLAS's batched GEMM rather than a Triton GEMM prologue.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._common import check_device, interpreting, next_pow2
from kernels.triton._v4_qkv_kernels import (
    v4_kv_prologue_kernel,
    v4_o_derotate_kernel,
    v4_q_prologue_kernel,
)

# elements of one program's head tile in the q and o kernels: 2 heads at head_dim 512,
# so a batch-1 step still spreads over H / 2 programs
TILE_ELEMENTS = 1024


def _check_rope(positions: torch.Tensor, inv_freq: torch.Tensor, rows: int, head_dim: int):
    assert positions.shape == (rows,), f"positions must be [{rows}], got {list(positions.shape)}"
    assert inv_freq.dim() == 1 and inv_freq.dtype == torch.float32, (
        f"inv_freq must be [P/2] float32, got {list(inv_freq.shape)} {inv_freq.dtype}"
    )
    assert 2 * inv_freq.shape[0] <= head_dim, f"rope dims {2 * inv_freq.shape[0]} > {head_dim}"
    assert inv_freq.is_contiguous() and positions.is_contiguous()


def _heads_per_program(n_heads: int, head_dim: int) -> int:
    return min(next_pow2(n_heads), max(1, TILE_ELEMENTS // next_pow2(head_dim)))


def v4_q_prologue(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float, n_heads: int
) -> torch.Tensor:
    """x [B, H * head_dim] (wq_b's output) -> q [B, H, head_dim] in x's dtype: per-head
    unit RMS, then the rope at each row's position."""
    assert x.dim() == 2 and x.shape[1] % n_heads == 0, (
        f"x must be [B, {n_heads} * head_dim], got {list(x.shape)}"
    )
    assert x.stride(1) == 1, "x needs a contiguous last dim"
    rows, head_dim = x.shape[0], x.shape[1] // n_heads
    _check_rope(positions, inv_freq, rows, head_dim)
    check_device(x, positions, inv_freq)
    q = torch.empty(rows, n_heads, head_dim, dtype=x.dtype, device=x.device)
    block_h = _heads_per_program(n_heads, head_dim)
    half = inv_freq.shape[0]
    if rows:
        v4_q_prologue_kernel[(rows, triton.cdiv(n_heads, block_h))](
            x, positions, inv_freq, q, n_heads, eps,
            x.stride(0), q.stride(0), q.stride(1),
            HEAD_DIM=head_dim, HALF=half, PRECISE_TRIG=not interpreting(),
            BLOCK_H=block_h, BLOCK_D=next_pow2(head_dim), BLOCK_J=next_pow2(half),
        )  # fmt: skip
    return q


def v4_kv_prologue(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """x [B, head_dim] (wkv's output) -> kv [B, head_dim] in x's dtype: RMSNorm with
    `weight` [head_dim], then the rope; also written (in the ring's dtype) into ring
    [slots, ring_size, head_dim] at [slots[b], positions[b] % ring_size]. Rows must name
    distinct slots, as a decode step's sequences do."""
    assert x.dim() == 2 and x.stride(1) == 1, f"x must be [B, head_dim], got {list(x.shape)}"
    rows, head_dim = x.shape
    assert weight.shape == (head_dim,) and weight.is_contiguous(), (
        f"weight must be [{head_dim}], got {list(weight.shape)}"
    )
    assert ring.dim() == 3 and ring.shape[2] == head_dim and ring.stride(2) == 1, (
        f"ring must be [slots, ring_size, {head_dim}], got {list(ring.shape)}"
    )
    assert slots.shape == (rows,) and slots.is_contiguous(), (
        f"slots must be [{rows}], got {list(slots.shape)}"
    )
    _check_rope(positions, inv_freq, rows, head_dim)
    check_device(x, weight, positions, inv_freq, ring, slots)
    kv = torch.empty_like(x, memory_format=torch.contiguous_format)
    half = inv_freq.shape[0]
    if rows:
        v4_kv_prologue_kernel[(rows,)](
            x, weight, positions, inv_freq, slots, kv, ring, eps, ring.shape[1],
            x.stride(0), kv.stride(0), ring.stride(0), ring.stride(1),
            HEAD_DIM=head_dim, HALF=half, PRECISE_TRIG=not interpreting(),
            BLOCK_D=next_pow2(head_dim), BLOCK_J=next_pow2(half),
        )  # fmt: skip
    return kv


def v4_o_derotate(
    o: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, o_groups: int
) -> torch.Tensor:
    """o [B, H, head_dim] -> [o_groups, B, H * head_dim / o_groups] in o's dtype, each head
    rotated back by its row's position: group g holds heads g * H / o_groups ...,
    contiguous, as the grouped wo_a's batched matmul reads them."""
    assert o.dim() == 3 and o.stride(2) == 1, f"o must be [B, H, head_dim], got {list(o.shape)}"
    rows, n_heads, head_dim = o.shape
    assert n_heads % o_groups == 0, f"{n_heads} heads do not split into {o_groups} groups"
    _check_rope(positions, inv_freq, rows, head_dim)
    check_device(o, positions, inv_freq)
    heads_per_group = n_heads // o_groups
    out = torch.empty(o_groups, rows, heads_per_group * head_dim, dtype=o.dtype, device=o.device)
    block_h = _heads_per_program(n_heads, head_dim)
    half = inv_freq.shape[0]
    if rows:
        v4_o_derotate_kernel[(rows, triton.cdiv(n_heads, block_h))](
            o, positions, inv_freq, out, n_heads, heads_per_group,
            o.stride(0), o.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HALF=half, PRECISE_TRIG=not interpreting(),
            BLOCK_H=block_h, BLOCK_D=next_pow2(head_dim), BLOCK_J=next_pow2(half),
        )  # fmt: skip
    return out


def v4_o_epilogue(
    o: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, wo_a: torch.Tensor
) -> torch.Tensor:
    """o [B, H, head_dim] (rotated as its keys were), wo_a [o_groups * o_lora_rank,
    H * head_dim / o_groups] in o's dtype -> [B, o_groups * o_lora_rank], wo_b's input:
    the de-rotation, then group g's heads times its own o_lora_rank rows of wo_a. The
    matmul writes through a [o_groups, B, o_lora_rank] view of the [B, ...] output (batch
    stride o_lora_rank, row stride o_groups * o_lora_rank): strides a cuBLAS batched GEMM
    addresses directly (ATen copies only a layout it cannot pass, which this is not)."""
    rows, n_heads, head_dim = o.shape
    width = wo_a.shape[1]
    assert wo_a.dim() == 2 and (n_heads * head_dim) % width == 0, (
        f"wo_a {list(wo_a.shape)} does not split {n_heads} x {head_dim} into groups"
    )
    o_groups = n_heads * head_dim // width
    assert wo_a.shape[0] % o_groups == 0 and wo_a.dtype == o.dtype and wo_a.is_contiguous(), (
        f"wo_a must be [{o_groups} * o_lora_rank, {width}] contiguous in {o.dtype}"
    )
    rank = wo_a.shape[0] // o_groups
    x = v4_o_derotate(o, positions, inv_freq, o_groups)  # [o_groups, B, width]
    y = torch.empty(rows, o_groups * rank, dtype=o.dtype, device=o.device)
    w = wo_a.view(o_groups, rank, width).transpose(1, 2)  # [o_groups, width, rank]
    torch.bmm(x, w, out=y.view(rows, o_groups, rank).transpose(0, 1))
    return y
