"""Routed experts that live in host RAM, computed on the CPU in their stored precision:
MXFP4 experts (DeepSeek-V4) as int8 dot products, FP8 experts (V3, `expert_dtype: fp8`) in
float32. No engine imports: the engine's host-expert backend calls `host_experts_forward`.

Layout (`HostMxfp4Experts`, re-laid once by `put` from the checkpoint's
gate/up [I, D/2] + [I, D/32] and down [D, I/2] + [D, I/32], R = ROWS = 4):
- gate_up [S, I/R, D/32, 2R, 16] uint8: for each block of R intermediate rows and each
  32-value input block, the R gate rows then the R up rows, 16 bytes each; byte j holds
  element j in its low nibble and element 16 + j in its high nibble. One activation block
  serves 2R rows, and a row block's gate and up meet in one work item, so SwiGLU is fused.
- gate_up_scales [S, I/R, D/32, 2R] uint8 E8M0, grouped the same way.
- down [S, D/R, I/32, R, 16], down_scales [S, D/R, I/32, R]: the same for down.
Memory is the stored bytes exactly (`nbytes`): no float copy of any weight.

Arithmetic (MXFP4): activations are quantized per token per 32 values to int8
(`quantize_rows`; step = amax / 127), weights decode to 2 x E2M1, an exact int8. Each
output (pair, row) keeps 4 lanes; lane l of block b is the exact int32 dot of elements
4l..4l+3 and 16+4l..16+4l+3, and acc_l = sum over b in order of float32(dot) *
(half_step_b * 2^(e_b - 127)); the row is (acc_0 + acc_1) + (acc_2 + acc_3). SwiGLU (with
the limit's clamps) runs on the float32 gate/up, its output is quantized again per 32 and
goes through down the same way. FP8: each weight row is dequantized to float32 (E4M3 value
x block scale, as kernels/formats does), activations stay float32, and the dot sums 16
lanes (lane j: elements j, j + 16, ... in order) folded by halves (`float_dot` in
kernels/cpu/_host_experts_kernels.py).
Last, out[t] = sum over k in k order of weights[t, k] * y_k. Every order depends on the
layout alone, never on how many tokens share the call or chose the same expert: a row's
result does not depend on its batch.

Threads: the kernels run in numba's thread pool (`numba.set_num_threads(n)` before a call
sets how many of its threads take part; the pool's size is fixed at the first parallel call
by NUMBA_NUM_THREADS, default all cores). On a GPU run give numba the cores and keep torch's
pool small (`torch.set_num_threads(1)` or 2), so their spinning threads do not take each
other's cores (docs/notes-cpu-decode.md measured 7 ms per matmul lost on 2 cores to that).

Legend: S = host slots, T = tokens, K = experts per token, P = (token, expert) pairs on the
host, D = hidden, I = intermediate.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kernels.cpu import _host_experts_kernels as _k
from kernels.formats.e8m0 import check_e8m0, e8m0_bytes
from kernels.formats.fp8 import FP8_DTYPE, scale_grid, scale_to_float

ROWS = _k.ROWS
GROUP = _k.GROUP


def _expect(tensor: torch.Tensor, name: str, shape: tuple[int, ...], dtypes) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}: expected a torch tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor, got device {tensor.device}")
    if tensor.dtype not in dtypes:
        raise TypeError(
            f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {tensor.dtype}"
        )
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(tensor.shape)}")


def _check_slot(slot: int, num_slots: int) -> None:
    if not 0 <= slot < num_slots:
        raise IndexError(f"slot {slot} out of range: this layer has {num_slots} host slots")


def _relay_mxfp4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K/2] checkpoint bytes (low nibble = even k) -> [N/R, K/32, R, 16] bytes, byte j
    of a block holding element j (low nibble) and element 16 + j (high nibble)."""
    n, half = packed.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(n, half * 2 // GROUP, 2, 16)
    relaid = codes[:, :, 0] | (codes[:, :, 1] << 4)  # [N, K/32, 16]
    return relaid.reshape(n // ROWS, ROWS, -1, 16).transpose(1, 2)


def _group_scales(scales: torch.Tensor) -> torch.Tensor:
    """[N, K/32] -> [N/R, K/32, R]."""
    n, blocks = scales.shape
    return scales.reshape(n // ROWS, ROWS, blocks).transpose(1, 2)


class HostMxfp4Experts:
    """The MXFP4 experts of one layer in host RAM, in the kernel's layout (module
    docstring). `allocate`, then `put` each expert into its slot as the loader reads it."""

    def __init__(self, gate_up, gate_up_scales, down, down_scales):
        self.gate_up = gate_up  # [S, I/R, D/32, 2R, 16] uint8
        self.gate_up_scales = gate_up_scales  # [S, I/R, D/32, 2R] uint8
        self.down = down  # [S, D/R, I/32, R, 16] uint8
        self.down_scales = down_scales  # [S, D/R, I/32, R] uint8
        self.num_slots = gate_up.shape[0]
        self.intermediate = gate_up.shape[1] * ROWS
        self.hidden = down.shape[1] * ROWS

    @classmethod
    def allocate(cls, num_slots: int, hidden: int, intermediate: int) -> HostMxfp4Experts:
        """Empty slots for experts of hidden size D and intermediate size I (both multiples
        of 32)."""
        for name, size in (("hidden", hidden), ("intermediate", intermediate)):
            if size <= 0 or size % GROUP:
                raise ValueError(f"{name} size must be a positive multiple of {GROUP}, got {size}")
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        d, i = hidden, intermediate
        return cls(
            np.empty((num_slots, i // ROWS, d // GROUP, 2 * ROWS, 16), dtype=np.uint8),
            np.empty((num_slots, i // ROWS, d // GROUP, 2 * ROWS), dtype=np.uint8),
            np.empty((num_slots, d // ROWS, i // GROUP, ROWS, 16), dtype=np.uint8),
            np.empty((num_slots, d // ROWS, i // GROUP, ROWS), dtype=np.uint8),
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.gate_up, self.gate_up_scales, self.down, self.down_scales)
        return sum(a.nbytes for a in arrays)

    def put(self, slot, gate_w, gate_s, up_w, up_s, down_w, down_s) -> None:
        """Re-lay one expert, given in the checkpoint's layout (uint8 nibbles, E8M0 scales
        as uint8 or float8_e8m0fnu), into `slot`."""
        _check_slot(slot, self.num_slots)
        d, i = self.hidden, self.intermediate
        scale_dtypes = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
        for name, tensor, shape in (
            ("gate weight", gate_w, (i, d // 2)),
            ("up weight", up_w, (i, d // 2)),
            ("down weight", down_w, (d, i // 2)),
        ):
            _expect(tensor, f"slot {slot} {name}", shape, (torch.uint8,))
        for name, tensor, shape in (
            ("gate scale", gate_s, (i, d // GROUP)),
            ("up scale", up_s, (i, d // GROUP)),
            ("down scale", down_s, (d, i // GROUP)),
        ):
            _expect(tensor, f"slot {slot} {name}", shape, scale_dtypes)
            check_e8m0(tensor, f"slot {slot} {name}")
        gate_up = torch.cat((_relay_mxfp4(gate_w), _relay_mxfp4(up_w)), dim=2)
        self.gate_up[slot] = gate_up.numpy()
        scales = (_group_scales(e8m0_bytes(gate_s)), _group_scales(e8m0_bytes(up_s)))
        self.gate_up_scales[slot] = torch.cat(scales, dim=2).numpy()
        self.down[slot] = _relay_mxfp4(down_w).numpy()
        self.down_scales[slot] = _group_scales(e8m0_bytes(down_s)).numpy()


class HostFp8Experts:
    """The FP8 (E4M3, 128x128 block scales) experts of one layer in host RAM: weights as
    their bytes in the checkpoint's [N, K] layout, scales as float32 (an E8M0 scale
    converts exactly)."""

    def __init__(self, gate, up, down, gate_scales, up_scales, down_scales):
        self.gate, self.up, self.down = gate, up, down  # [S, I, D], [S, I, D], [S, D, I] uint8
        self.gate_scales = gate_scales  # [S, I/128, D/128] float32 (edge blocks rounded up)
        self.up_scales = up_scales
        self.down_scales = down_scales  # [S, D/128, I/128]
        self.num_slots, self.intermediate, self.hidden = gate.shape

    @classmethod
    def allocate(cls, num_slots: int, hidden: int, intermediate: int) -> HostFp8Experts:
        """Empty slots for experts of hidden size D and intermediate size I (multiples of
        16)."""
        for name, size in (("hidden", hidden), ("intermediate", intermediate)):
            if size <= 0 or size % _k.LANES:
                raise ValueError(
                    f"{name} size must be a positive multiple of {_k.LANES}, got {size}"
                )
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        d, i = hidden, intermediate
        return cls(
            np.empty((num_slots, i, d), dtype=np.uint8),
            np.empty((num_slots, i, d), dtype=np.uint8),
            np.empty((num_slots, d, i), dtype=np.uint8),
            np.empty((num_slots, *scale_grid(i, d)), dtype=np.float32),
            np.empty((num_slots, *scale_grid(i, d)), dtype=np.float32),
            np.empty((num_slots, *scale_grid(d, i)), dtype=np.float32),
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.gate, self.up, self.down, self.gate_scales, self.up_scales, self.down_scales)
        return sum(a.nbytes for a in arrays)

    def put(self, slot, gate_w, gate_s, up_w, up_s, down_w, down_s) -> None:
        """Store one expert: weights float8_e4m3fn (or their uint8 bytes), block scales
        float32/bfloat16 (V3's weight_scale_inv) or E8M0 (uint8 / float8_e8m0fnu, V4)."""
        _check_slot(slot, self.num_slots)
        d, i = self.hidden, self.intermediate
        scale_dtypes = (torch.float32, torch.bfloat16, torch.uint8)
        scale_dtypes += tuple(t for t in (getattr(torch, "float8_e8m0fnu", None),) if t)
        parts = (
            ("gate", gate_w, gate_s, (i, d), self.gate, self.gate_scales),
            ("up", up_w, up_s, (i, d), self.up, self.up_scales),
            ("down", down_w, down_s, (d, i), self.down, self.down_scales),
        )
        for name, w, s, shape, _, _ in parts:
            _expect(w, f"slot {slot} {name} weight", shape, (FP8_DTYPE, torch.uint8))
            _expect(s, f"slot {slot} {name} scale", scale_grid(*shape), scale_dtypes)
            if s.dtype not in (torch.float32, torch.bfloat16):
                check_e8m0(s, f"slot {slot} {name} scale")
        for _, w, s, _, weights, scales in parts:
            weights[slot] = (w.view(torch.uint8) if w.dtype == FP8_DTYPE else w).numpy()
            scales[slot] = scale_to_float(s).numpy()


def _group_pairs(slot_ids: np.ndarray, num_slots: int):
    """(active slots, pair offsets per active slot, token of each pair, pair of each
    (t, k) or -1): pairs grouped by slot, tokens in order within a slot."""
    flat = slot_ids.reshape(-1)
    if flat.size and (flat.max() >= num_slots or flat.min() < -1):
        bad = int(flat[(flat >= num_slots) | (flat < -1)][0])
        raise IndexError(f"slot_ids holds {bad}: this layer has {num_slots} host slots (-1: skip)")
    chosen = np.flatnonzero(flat >= 0)
    order = chosen[np.argsort(flat[chosen], kind="stable")]  # (t, k) flat indices by slot
    pair_of = np.full(flat.shape, -1, dtype=np.int32)
    pair_of[order] = np.arange(order.size, dtype=np.int32)
    slots, counts = np.unique(flat[order], return_counts=True)
    offsets = np.zeros(slots.size + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    pair_token = (order // slot_ids.shape[1]).astype(np.int32)
    return slots.astype(np.int32), offsets, pair_token, pair_of.reshape(slot_ids.shape)


def host_experts_forward(experts, x, slot_ids, weights, swiglu_limit, out) -> None:
    """out[t] = sum over k with slot_ids[t, k] >= 0 of weights[t, k] * expert(x[t]), written
    (not accumulated); tokens with no host expert get zeros.

    experts: HostMxfp4Experts or HostFp8Experts; x [T, D] float32; slot_ids [T, K] int32
    (a host slot, or -1 for an expert computed elsewhere); weights [T, K] float32; out
    [T, D] float32; all contiguous CPU tensors. swiglu_limit: V4's clamp, or None."""
    t, d = x.shape
    top_k = slot_ids.shape[1] if slot_ids.dim() == 2 else -1
    _expect(x, "x", (t, experts.hidden), (torch.float32,))
    _expect(slot_ids, "slot_ids", (t, top_k), (torch.int32,))
    _expect(weights, "weights", (t, top_k), (torch.float32,))
    _expect(out, "out", (t, d), (torch.float32,))
    for name, tensor in (("x", x), ("slot_ids", slot_ids), ("weights", weights), ("out", out)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    limit = np.float32(math.inf if swiglu_limit is None else swiglu_limit)
    slots, offsets, pair_token, pair_of = _group_pairs(slot_ids.numpy(), experts.num_slots)
    pairs = pair_token.size
    xn, outn = x.numpy(), out.numpy()
    y = np.empty((pairs, d), dtype=np.float32)
    if pairs:
        identity = np.arange(pairs, dtype=np.int32)
        if isinstance(experts, HostMxfp4Experts):
            _mxfp4_pairs(experts, xn, slots, offsets, pair_token, identity, limit, y)
        elif isinstance(experts, HostFp8Experts):
            _fp8_pairs(experts, xn, slots, offsets, pair_token, identity, limit, y)
        else:
            raise TypeError(
                f"experts must be HostMxfp4Experts or HostFp8Experts, got {type(experts).__name__}"
            )
    _k.combine(y, pair_of, weights.numpy(), outn)


def _mxfp4_pairs(e, x, slots, offsets, pair_token, identity, limit, y):
    rows = _k.mxfp4_rows_vnni if _k.VNNI else _k.mxfp4_rows
    xq, xs, xl = _quantized(x)
    h = np.empty((pair_token.size, e.intermediate), dtype=np.float32)  # [P, I]
    rows(e.gate_up, e.gate_up_scales, xq, xs, xl, slots, offsets, pair_token, limit, h)
    hq, hs, hl = _quantized(h)
    rows(e.down, e.down_scales, hq, hs, hl, slots, offsets, identity, limit, y)


def _quantized(x: np.ndarray):
    """int8 codes [N, C], half steps [N, C/32] and VNNI lane bias [N, C/8] of x [N, C]."""
    n, c = x.shape
    q = np.empty((n, c), dtype=np.int8)
    half_step = np.empty((n, c // GROUP), dtype=np.float32)
    lane_bias = np.empty((n, c // GROUP * _k.LANES_PER_ROW), dtype=np.int32)
    _k.quantize_rows(x, q, half_step, lane_bias)
    return q, half_step, lane_bias


def _fp8_pairs(e, x, slots, offsets, pair_token, identity, limit, y):
    h = np.empty((pair_token.size, e.intermediate), dtype=np.float32)  # [P, I]
    _k.fp8_rows(
        e.gate, e.up, e.gate_scales, e.up_scales, x, slots, offsets, pair_token, True, limit, h
    )
    _k.fp8_rows(
        e.down, e.down, e.down_scales, e.down_scales, h, slots, offsets, identity, False, limit, y
    )
