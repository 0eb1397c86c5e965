"""Routed experts that live in host RAM, computed on the CPU in their stored precision:
MXFP4 experts (DeepSeek-V4) as int8 dot products (or in float32 for float32 models), FP8
experts (V3, `expert_dtype: fp8`) in float32. No engine imports: the engine's host-expert
store (engine/layers/host_experts.py) calls `host_experts_routed`.

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
MXFP4 with `float32_activations` (the exact mode, for float32 models): each weight row
decodes exactly to float32 (E2M1 value x 2^(e - 127), what kernels/formats gives), x and
the SwiGLU output stay float32, and the dots are `float_dot`'s, as for FP8.
Last, out[t] = sum over k in k order of weights[t, k] * y_k. Every order depends on the
layout alone, never on how many tokens share the call or chose the same expert: a row's
result does not depend on its batch.

One call per layer (`host_experts_routed`, global expert ids and the layer's slot_of
map; `host_experts_forward` with host slots): one compiled function groups the pairs,
runs gate/up with SwiGLU and down (one wake of numba's pool each; the activation
quantization and the combine run on the calling thread at decode sizes) and combines. Its
scratch buffers belong to the calling thread, one set per expert shape and mode, grown
when a call needs more (engine calls of one model come one after another on one thread);
the checks are O(1) and skipped for a tensor set seen just before (a CUDA graph's pinned
buffers, the same objects at every replay).

Threads: the kernels run in numba's thread pool; `set_threads(n)` says how many of its
threads take part, in every thread that calls (numba's own set_num_threads holds only for
the thread that calls it, and a CUDA graph's host nodes run on the driver's thread). The
pool's size is fixed at the first parallel call by NUMBA_NUM_THREADS, default all cores. On a GPU run give numba the cores and keep torch's
pool small (`torch.set_num_threads(1)` or 2), so their spinning threads do not take each
other's cores (docs/notes-cpu-decode.md measured 7 ms per matmul lost on 2 cores to that).

Legend: S = host slots, T = tokens, K = experts per token, P = (token, expert) pairs on the
host, D = hidden, I = intermediate.
"""

from __future__ import annotations

import math
import threading

import numba
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
        self.identity_slots = np.arange(self.num_slots, dtype=np.int32)
        # float32 activations and dots (exact MXFP4 x float32, for float32 models) instead
        # of int8 activations (module docstring)
        self.float32_activations = False

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
        self.identity_slots = np.arange(self.num_slots, dtype=np.int32)

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


class _Scratch:
    """The buffers of one call (pair grouping, quantized activations, h, y), reused by
    every call on one thread for experts of one shape and mode, grown when a call needs
    more; nothing in them outlives a call."""

    def __init__(self, hidden: int, intermediate: int, quantized: bool) -> None:
        self.hidden, self.intermediate, self.quantized = hidden, intermediate, quantized
        self.tokens = self.flat = self.slots = self.pairs = 0
        self._tokens_arrays(0)
        self._slot_arrays(0)
        self.pair_of = np.empty(0, dtype=np.int32)
        self.grow_pairs(MIN_PAIRS)

    def _tokens_arrays(self, tokens: int) -> None:
        d, rows = self.hidden, tokens if self.quantized else 0
        self.tokens = tokens
        self.xq = np.empty((rows, d), dtype=np.int8)
        self.xs = np.empty((rows, d // GROUP), dtype=np.float32)
        self.xl = np.empty((rows, d // GROUP * _k.LANES_PER_ROW), dtype=np.int32)

    def _slot_arrays(self, slots: int) -> None:
        self.slots = slots
        self.cursor = np.empty(slots, dtype=np.int32)
        self.active = np.empty(slots, dtype=np.int32)
        self.offsets = np.empty(slots + 1, dtype=np.int32)

    def fit(self, tokens: int, top_k: int, num_slots: int) -> None:
        """Room for a call of `tokens` x `top_k` choices over `num_slots` slots (O(1)
        unless it grows)."""
        if tokens > self.tokens:
            self._tokens_arrays(_grown(tokens))
        if tokens * top_k > self.flat:
            self.flat = _grown(tokens * top_k)
            self.pair_of = np.empty(self.flat, dtype=np.int32)
        if num_slots > self.slots:
            self._slot_arrays(num_slots)

    def grow_pairs(self, pairs: int) -> None:
        d, i = self.hidden, self.intermediate
        self.pairs = p = _grown(pairs)
        q = p if self.quantized else 0
        self.pair_token = np.empty(p, dtype=np.int32)
        self.identity = np.arange(p, dtype=np.int32)
        self.h = np.empty((p, i), dtype=np.float32)
        self.hq = np.empty((q, i), dtype=np.int8)
        self.hs = np.empty((q, i // GROUP), dtype=np.float32)
        self.hl = np.empty((q, i // GROUP * _k.LANES_PER_ROW), dtype=np.int32)
        self.y = np.empty((p, d), dtype=np.float32)

    def grouping(self) -> tuple[np.ndarray, ...]:
        return (self.cursor, self.active, self.offsets, self.pair_token, self.identity,
                self.pair_of)  # fmt: skip


MIN_PAIRS = 16  # pair capacity of a new scratch


def _grown(n: int) -> int:
    """n rounded up to a power of two (at least 1): a growing batch re-allocates rarely."""
    return 1 << max(0, n - 1).bit_length()


class _ThreadState:
    """One thread's scratch buffers (by expert shape and mode) and remembered tensors."""

    def __init__(self) -> None:
        self.scratch: dict[tuple, _Scratch] = {}
        self.seen = _SeenTensors()


_threads: int | None = None  # set_threads; None: numba's default in each thread


def set_threads(n: int | None) -> None:
    """How many of numba's threads each host expert call uses, whichever thread makes it
    (None: numba's default, NUMBA_NUM_THREADS)."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    _threads = n


def _use_threads() -> None:
    if _threads is not None and numba.get_num_threads() != _threads:
        numba.set_num_threads(min(_threads, numba.config.NUMBA_NUM_THREADS))


# By OS thread id, not threading.local: the CUDA driver runs a graph's host nodes on its own
# thread through ctypes, which gives each callback a new Python thread state (and so an
# empty threading.local), while the thread itself, and its id, stay the same.
_by_thread: dict[int, _ThreadState] = {}


def _thread_state() -> _ThreadState:
    ident = threading.get_ident()
    state = _by_thread.get(ident)
    if state is None:
        state = _by_thread[ident] = _ThreadState()
    return state


def _scratch(state: _ThreadState, experts, quantized: bool) -> _Scratch:
    """A thread's scratch for experts of this shape and mode: the engine's host calls of
    one model run one after another on one thread (the CUDA driver's, or the caller's)."""
    table = state.scratch
    key = (type(experts), experts.hidden, experts.intermediate, quantized)
    scratch = table.get(key)
    if scratch is None:
        scratch = table[key] = _Scratch(experts.hidden, experts.intermediate, quantized)
    return scratch


_IDS_DTYPES = (torch.int32, torch.int64)


def _check_call(experts, x, ids, weights, out, ids_name) -> None:
    """Shapes, dtypes, device and layout of one call's tensors: O(1), the messages only
    on failure."""
    try:
        fast = (
            x.dtype is torch.float32
            and weights.dtype is torch.float32
            and out.dtype is torch.float32
            and ids.dtype in _IDS_DTYPES
            and x.dim() == 2
            and x.shape[1] == experts.hidden
            and out.shape == x.shape
            and ids.dim() == 2
            and ids.shape[0] == x.shape[0]
            and weights.shape == ids.shape
            and x.device.type == "cpu"
            and ids.device.type == "cpu"
            and weights.device.type == "cpu"
            and out.device.type == "cpu"
            and x.is_contiguous()
            and ids.is_contiguous()
            and weights.is_contiguous()
            and out.is_contiguous()
        )
    except AttributeError:
        fast = False
    if fast:
        return
    t = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
    top_k = ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else -1
    _expect(x, "x", (t, experts.hidden), (torch.float32,))
    _expect(ids, ids_name, (t, top_k), _IDS_DTYPES)
    _expect(weights, "weights", (t, top_k), (torch.float32,))
    _expect(out, "out", (t, experts.hidden), (torch.float32,))
    for name, tensor in (("x", x), (ids_name, ids), ("weights", weights), ("out", out)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


class _SeenTensors:
    """The numpy views of the last checked (x, ids, weights, out) tensor sets of one
    thread. A CUDA graph's host node passes the same pinned tensor objects at every replay
    and to every layer, and a tensor object keeps its shape, dtype and memory (nothing here
    resizes one), so a set seen before needs neither the checks nor new views. The views
    keep their tensors alive: only sets of up to MAX_TOKENS tokens are kept, and few."""

    SIZE = 2
    MAX_TOKENS = 1024

    def __init__(self) -> None:
        self.entries: list[tuple] = []

    def arrays(self, hidden, x, ids, weights, out):
        """The views of a set checked before for experts of this hidden size, or None."""
        for entry in self.entries:
            if (
                entry[0] is x
                and entry[1] is ids
                and entry[2] is weights
                and entry[3] is out
                and entry[4] == hidden
            ):
                return entry[5]
        return None

    def remember(self, hidden, x, ids, weights, out):
        arrays = (x.numpy(), ids.numpy(), weights.numpy(), out.numpy())
        if x.shape[0] <= self.MAX_TOKENS:
            entry = (x, ids, weights, out, hidden, arrays)
            self.entries = [entry, *self.entries[: self.SIZE - 1]]
        return arrays


def host_experts_routed(experts, slot_of, x, expert_ids, weights, swiglu_limit, out) -> int:
    """out[t] = sum over k, in k order, of weights[t, k] * expert_ids[t, k](x[t]) for the
    experts that live here (slot_of[expert] >= 0), written (not accumulated); tokens with
    none get zeros. Returns the (token, expert) pairs computed.

    One compiled call does the grouping, the experts and the combine (numba's pool wakes
    once per weight pass). experts: HostMxfp4Experts or HostFp8Experts; slot_of [E] int32
    numpy (global id -> host slot, -1: computed elsewhere); x [T, D] float32; expert_ids
    [T, K] int32 or int64 global ids (-1: no expert); weights [T, K] float32; out [T, D]
    float32; contiguous CPU tensors. swiglu_limit: V4's clamp, or None."""
    if not (
        isinstance(slot_of, np.ndarray)
        and slot_of.dtype == np.int32
        and slot_of.ndim == 1
        and slot_of.flags.c_contiguous
    ):
        raise TypeError(f"slot_of: expected a contiguous 1-d int32 numpy array, got {slot_of!r}")
    what = f"the layer has {slot_of.shape[0]} experts (-1: none)"
    return _run(experts, slot_of, x, expert_ids, weights, swiglu_limit, out, "expert_ids", what)


def host_experts_forward(experts, x, slot_ids, weights, swiglu_limit, out) -> int:
    """host_experts_routed with host slots for ids: slot_ids [T, K] int32 or int64 (a host
    slot, or -1 for an expert computed elsewhere)."""
    what = f"this layer has {experts.num_slots} host slots (-1: skip)"
    slot_of = experts.identity_slots
    return _run(experts, slot_of, x, slot_ids, weights, swiglu_limit, out, "slot_ids", what)


def _run(experts, slot_of, x, ids, weights, swiglu_limit, out, ids_name, what) -> int:
    if not isinstance(experts, (HostMxfp4Experts, HostFp8Experts)):
        raise TypeError(
            f"experts must be HostMxfp4Experts or HostFp8Experts, got {type(experts).__name__}"
        )
    state = _thread_state()
    _use_threads()
    seen = state.seen
    arrays = seen.arrays(experts.hidden, x, ids, weights, out)
    if arrays is None:
        _check_call(experts, x, ids, weights, out, ids_name)
        arrays = seen.remember(experts.hidden, x, ids, weights, out)
    limit = np.float32(math.inf if swiglu_limit is None else swiglu_limit)
    t, top_k = ids.shape
    xn, idn, wn, outn = arrays
    call = (slot_of, idn, wn, xn, limit, outn)
    if isinstance(experts, HostMxfp4Experts):
        exact = experts.float32_activations
        scratch = _scratch(state, experts, not exact)
        scratch.fit(t, top_k, experts.num_slots)
        e = experts
        while True:
            code, value = _k.mxfp4_forward(
                e.gate_up, e.gate_up_scales, e.down, e.down_scales, *call,
                *scratch.grouping(), exact, scratch.xq, scratch.xs, scratch.xl,
                scratch.h, scratch.hq, scratch.hs, scratch.hl, scratch.y,
            )  # fmt: skip
            if code != _k.NEED_PAIRS:
                break
            scratch.grow_pairs(value)
    else:
        scratch = _scratch(state, experts, False)
        scratch.fit(t, top_k, experts.num_slots)
        e = experts
        while True:
            code, value = _k.fp8_forward(
                e.gate, e.up, e.down, e.gate_scales, e.up_scales, e.down_scales, *call,
                *scratch.grouping(), scratch.h, scratch.y,
            )  # fmt: skip
            if code != _k.NEED_PAIRS:
                break
            scratch.grow_pairs(value)
    if code == _k.BAD_ID:
        row, k = divmod(value, top_k)
        raise IndexError(f"{ids_name}[{row}, {k}] holds {int(ids[row, k])}: {what}")
    if code == _k.BAD_SLOT:
        raise IndexError(
            f"slot_of[{value}] holds {int(slot_of[value])}: this layer has "
            f"{experts.num_slots} host slots (-1: elsewhere)"
        )
    return value


def _quantized(x: np.ndarray):
    """int8 codes [N, C], half steps [N, C/32] and VNNI lane bias [N, C/8] of x [N, C]."""
    n, c = x.shape
    q = np.empty((n, c), dtype=np.int8)
    half_step = np.empty((n, c // GROUP), dtype=np.float32)
    lane_bias = np.empty((n, c // GROUP * _k.LANES_PER_ROW), dtype=np.int32)
    _k.quantize_rows(x, q, half_step, lane_bias)
    return q, half_step, lane_bias
