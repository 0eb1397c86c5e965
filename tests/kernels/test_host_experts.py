"""The host expert kernels (kernels/cpu/host_experts.py) against their torch twin
(kernels/reference/host_experts.py) on fresh random experts: MXFP4 with int8 activations
and with float32 ones (the exact mode), FP8 in float32, V4's SwiGLU clamps, slots computed
elsewhere (-1), global ids through slot_of, the one-call driver against the kernels run
step by step, batch invariance and bad input."""

import numpy as np
import pytest
import torch

from kernels.cpu import _host_experts_kernels as kernels
from kernels.cpu.host_experts import (
    HostFp8Experts,
    HostMxfp4Experts,
    _quantized,
    host_experts_forward,
    host_experts_routed,
)
from kernels.formats.e8m0 import e8m0_to_float
from kernels.formats.fp8 import quantize_fp8_block
from kernels.formats.mxfp4 import quantize_mxfp4
from kernels.reference.host_experts import (
    fp8_experts_reference,
    mxfp4_experts_reference,
    quantize_int8_blocks,
)
from tests.kernels._helpers import poisoned, rel_err

PARTS = ("gate_w", "gate_s", "up_w", "up_s", "down_w", "down_s")


def _stored(quantize, slots, hidden, intermediate, seed):
    """Random experts in the checkpoint's layout, stacked per part [S, ...]."""
    g = torch.Generator().manual_seed(seed)
    shapes = {
        "gate": (intermediate, hidden),
        "up": (intermediate, hidden),
        "down": (hidden, intermediate),
    }
    stored = {}
    for name, shape in shapes.items():
        # rows of different magnitudes, so the per-block scales differ
        pairs = [
            quantize(torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.2)
            for _ in range(slots)
        ]
        stored[f"{name}_w"] = torch.stack([w for w, _ in pairs])
        stored[f"{name}_s"] = torch.stack([s for _, s in pairs])
    return stored


def _host(cls, stored, float32_activations=False):
    slots, intermediate, _ = stored["gate_w"].shape
    hidden = stored["down_w"].shape[1]
    experts = cls.allocate(slots, hidden, intermediate)
    for s in range(slots):
        experts.put(s, *(stored[p][s] for p in PARTS))
    if float32_activations:
        experts.float32_activations = True
    return experts


def _inputs(tokens, top_k, slots, hidden, seed):
    """x [T, D], distinct slots per token with some left to other devices (-1), weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(slots, generator=g)[:top_k] for _ in range(tokens)])
    ids[torch.rand(tokens, top_k, generator=g) < 0.3] = -1
    weights = torch.rand(tokens, top_k, generator=g)
    return torch.randn(tokens, hidden, generator=g), ids.to(torch.int32), weights


def _forward(experts, x, ids, weights, limit):
    out = poisoned(x.shape, torch.float32, "cpu")
    host_experts_forward(experts, x, ids, weights, limit, out)
    return out


MXFP4_SHAPES = [(64, 96, 4, 2), (128, 32, 6, 3)]  # (D, I, slots, top_k)


@pytest.mark.parametrize("hidden,intermediate,slots,top_k", MXFP4_SHAPES)
@pytest.mark.parametrize("limit", [None, 0.02])
def test_mxfp4_matches_the_twin(hidden, intermediate, slots, top_k, limit):
    stored = _stored(quantize_mxfp4, slots, hidden, intermediate, seed=hidden + intermediate)
    experts = _host(HostMxfp4Experts, stored)
    x, ids, weights = _inputs(9, top_k, slots, hidden, seed=slots)
    out = _forward(experts, x, ids, weights, limit)
    same_rounding = mxfp4_experts_reference(stored, x, ids, weights, limit, True)
    exact = mxfp4_experts_reference(stored, x, ids, weights, limit)
    # the same int8 activations: only float rounding (and a rare code flip) differ
    assert rel_err(out, same_rounding) < 1e-4
    # against float activations: the int8 quantization's error (~1 / 127 per value)
    assert rel_err(out, exact) < 3e-2
    if limit is not None:
        unclamped = mxfp4_experts_reference(stored, x, ids, weights, None)
        assert rel_err(unclamped, exact) > 0.1, "the limit must clamp in this test"


@pytest.mark.parametrize("hidden,intermediate,slots,top_k", MXFP4_SHAPES)
@pytest.mark.parametrize("limit", [None, 0.02])
def test_mxfp4_float32_activations_match_the_exact_twin(hidden, intermediate, slots, top_k, limit):
    stored = _stored(quantize_mxfp4, slots, hidden, intermediate, seed=hidden * 3 + intermediate)
    experts = _host(HostMxfp4Experts, stored, float32_activations=True)
    x, ids, weights = _inputs(9, top_k, slots, hidden, seed=slots + 100)
    out = _forward(experts, x, ids, weights, limit)
    exact = mxfp4_experts_reference(stored, x, ids, weights, limit)
    # exactly decoded weights and float32 activations: only the dots' float32 order differs
    assert rel_err(out, exact) < 1e-6
    experts.float32_activations = False
    int8 = _forward(experts, x, ids, weights, limit)
    assert rel_err(int8, exact) > 1e-4, "the int8 mode quantizes, the float32 one must not"


def _stepwise(experts, x, slot_ids, weights, limit):
    """The kernels called one by one from Python, pairs grouped with numpy (a stable sort
    by slot): what host_experts_forward's single call must reproduce bit for bit."""
    flat = slot_ids.numpy().reshape(-1)
    chosen = np.flatnonzero(flat >= 0)
    order = chosen[np.argsort(flat[chosen], kind="stable")]
    pair_of = np.full(flat.shape, -1, dtype=np.int32)
    pair_of[order] = np.arange(order.size, dtype=np.int32)
    slots, counts = np.unique(flat[order], return_counts=True)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int32)
    slots = slots.astype(np.int32)
    pair_token = (order // slot_ids.shape[1]).astype(np.int32)
    identity = np.arange(order.size, dtype=np.int32)
    pairs, limit = order.size, np.float32(limit)
    y = np.zeros((pairs, experts.hidden), dtype=np.float32)
    h = np.empty((pairs, experts.intermediate), dtype=np.float32)
    e, xn = experts, x.numpy()
    if isinstance(e, HostFp8Experts):
        kernels.fp8_rows(e.gate, e.up, e.gate_scales, e.up_scales, xn, slots, offsets,
                         pair_token, True, limit, h)  # fmt: skip
        kernels.fp8_rows(e.down, e.down, e.down_scales, e.down_scales, h, slots, offsets,
                         identity, False, limit, y)  # fmt: skip
    else:
        rows = kernels.mxfp4_rows_vnni if kernels.VNNI else kernels.mxfp4_rows
        rows(e.gate_up, e.gate_up_scales, *_quantized(xn), slots, offsets, pair_token, limit, h)
        rows(e.down, e.down_scales, *_quantized(h), slots, offsets, identity, limit, y)
    # the combine: per token, from zeros, a multiply then an add per k in k order
    out = torch.zeros(x.shape)
    pair_of, y = torch.from_numpy(pair_of).view(slot_ids.shape), torch.from_numpy(y)
    for t in range(x.shape[0]):
        for k in range(slot_ids.shape[1]):
            if pair_of[t, k] >= 0:
                out[t] += weights[t, k] * y[pair_of[t, k]]
    return out


@pytest.mark.parametrize(
    "cls,quantize", [(HostMxfp4Experts, quantize_mxfp4), (HostFp8Experts, quantize_fp8_block)]
)
def test_one_call_gives_the_stepwise_kernels_bits(cls, quantize):
    hidden, intermediate, slots = 128, 64, 5
    experts = _host(cls, _stored(quantize, slots, hidden, intermediate, seed=71))
    for tokens, top_k in ((1, 3), (11, 4), (40, 3)):  # 40 x 3: the pair buffers grow
        x, ids, weights = _inputs(tokens, top_k, slots, hidden, seed=tokens)
        want = _stepwise(experts, x, ids, weights, 0.3)
        assert torch.equal(_forward(experts, x, ids, weights, 0.3), want), (tokens, top_k)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_global_ids_go_through_slot_of(ids_dtype):
    hidden, intermediate, num_experts = 64, 32, 10
    host_ids = (7, 2, 5)  # slot s holds global expert host_ids[s]
    stored = _stored(quantize_mxfp4, len(host_ids), hidden, intermediate, seed=81)
    experts = _host(HostMxfp4Experts, stored)
    slot_of = np.full(num_experts, -1, dtype=np.int32)
    slot_of[list(host_ids)] = np.arange(len(host_ids), dtype=np.int32)
    g = torch.Generator().manual_seed(82)
    tokens, top_k = 6, 4
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    ids[0] = torch.tensor([7, 2, 5, -1])  # every host expert, and no expert at all
    ids[1] = torch.tensor([0, 1, 3, 4])  # device experts only
    x = torch.randn(tokens, hidden, generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    out = poisoned(x.shape, torch.float32, "cpu")
    pairs = host_experts_routed(experts, slot_of, x, ids.to(ids_dtype), weights, 0.5, out)
    slot_ids = torch.from_numpy(slot_of)[ids.clamp(min=0)].masked_fill(ids < 0, -1)
    assert pairs == int((slot_ids >= 0).sum())
    assert torch.equal(out, _forward(experts, x, slot_ids, weights, 0.5))
    assert torch.equal(out[1], torch.zeros(hidden))
    ids[3, 2] = num_experts
    with pytest.raises(IndexError, match=r"expert_ids\[3, 2\] holds 10: the layer has 10"):
        host_experts_routed(experts, slot_of, x, ids.to(ids_dtype), weights, 0.5, out)
    ids[3, 2] = 0
    with pytest.raises(TypeError, match="slot_of: expected a contiguous 1-d int32"):
        host_experts_routed(experts, slot_of.astype(np.int64), x, ids, weights, 0.5, out)
    slot_of[0] = 3
    with pytest.raises(IndexError, match=r"slot_of\[0\] holds 3: this layer has 3 host slots"):
        host_experts_routed(experts, slot_of, x, ids.to(ids_dtype), weights, 0.5, out)


@pytest.mark.parametrize("scale_format", ["float32", "e8m0"])
@pytest.mark.parametrize("limit", [None, 0.02])
def test_fp8_matches_the_twin(scale_format, limit):
    # I = 144: a partial 128-block in both weights' scale grids
    stored = _stored(lambda w: quantize_fp8_block(w, scale_format), 3, 256, 144, seed=5)
    experts = _host(HostFp8Experts, stored)
    x, ids, weights = _inputs(7, 2, 3, 256, seed=8)
    out = _forward(experts, x, ids, weights, limit)
    ref = fp8_experts_reference(stored, x, ids, weights, limit)
    assert rel_err(out, ref) < 1e-5
    if limit is not None:
        assert rel_err(fp8_experts_reference(stored, x, ids, weights, None), ref) > 0.1


@pytest.mark.parametrize(
    "cls,quantize,exact",
    [
        (HostMxfp4Experts, quantize_mxfp4, False),
        (HostMxfp4Experts, quantize_mxfp4, True),
        (HostFp8Experts, quantize_fp8_block, False),
    ],
)
def test_a_tokens_output_does_not_depend_on_its_batch(cls, quantize, exact):
    hidden, intermediate, slots = 128, 64, 3
    experts = _host(cls, _stored(quantize, slots, hidden, intermediate, seed=11), exact)
    # 13 tokens over 3 slots: many share an expert, and tiles of pairs split unevenly
    x, ids, weights = _inputs(13, 2, slots, hidden, seed=12)
    batch = _forward(experts, x, ids, weights, 0.05)
    for t in range(13):
        alone = _forward(experts, x[t : t + 1], ids[t : t + 1], weights[t : t + 1], 0.05)
        assert torch.equal(alone[0], batch[t]), f"token {t}"
    # and with the batch in another order
    perm = torch.randperm(13, generator=torch.Generator().manual_seed(13))
    shuffled = _forward(
        experts, x[perm].contiguous(), ids[perm].contiguous(), weights[perm].contiguous(), 0.05
    )
    assert torch.equal(shuffled, batch[perm])


def test_skipped_slots_add_nothing_and_a_token_with_none_gets_zeros():
    stored = _stored(quantize_mxfp4, 2, 64, 32, seed=21)
    experts = _host(HostMxfp4Experts, stored)
    x, _, weights = _inputs(3, 2, 2, 64, seed=22)
    ids = torch.tensor([[-1, -1], [1, -1], [-1, 1]], dtype=torch.int32)
    out = _forward(experts, x, ids, weights, None)
    assert torch.equal(out[0], torch.zeros(64))
    only_one = _forward(
        experts, x[1:2], torch.tensor([[1, -1]], dtype=torch.int32), weights[1:2], None
    )
    assert torch.equal(out[1], only_one[0])
    assert rel_err(out, mxfp4_experts_reference(stored, x, ids, weights, None, True)) < 1e-4
    none_at_all = _forward(experts, x, torch.full((3, 2), -1, dtype=torch.int32), weights, None)
    assert torch.equal(none_at_all, torch.zeros(3, 64))


def test_int8_activations_match_the_twins_rounding_exactly():
    g = torch.Generator().manual_seed(31)
    x = torch.randn(5, 96, generator=g) * torch.rand(5, 1, generator=g)
    x[0, :32] = torch.arange(32) - 15.5  # ties (x / step = k + 0.5) round away from zero
    x[1, 32:64] = 0.0  # an all-zero block: the 1e-30 floor
    q, half_step, lane_bias = _quantized(x.numpy())
    steps = torch.from_numpy(half_step).repeat_interleave(32, 1) * 2
    assert torch.equal(torch.from_numpy(q).float() * steps, quantize_int8_blocks(x))
    # lane l of block b: codes 4l..4l+3 and 16+4l..16+4l+3, times minus the weight offset 12
    codes = torch.from_numpy(q).long().view(5, 3, 2, 4, 4)  # [N, B, half, lane, 4]
    want = codes.sum(dim=(2, 4)).view(5, 12) * -12
    assert torch.equal(torch.from_numpy(lane_bias).long(), want)


@pytest.mark.skipif(not kernels.VNNI, reason="needs AVX-512 BW + VNNI")
@pytest.mark.parametrize("fused", [True, False])
def test_vnni_kernel_gives_the_portable_kernels_bits(fused):
    hidden, intermediate, slots = 96, 64, 3
    experts = _host(HostMxfp4Experts, _stored(quantize_mxfp4, slots, hidden, intermediate, seed=61))
    if fused:
        w, s, width, out_width = experts.gate_up, experts.gate_up_scales, hidden, intermediate
    else:
        w, s, width, out_width = experts.down, experts.down_scales, intermediate, hidden
    # 11 activation rows read by 2 + 7 + 5 pairs: token tiles of 4, 3, 2 and 1
    g = torch.Generator().manual_seed(62)
    act = _quantized((torch.randn(11, width, generator=g) * 3).numpy())
    slot_list = np.array([2, 0, 1], dtype=np.int32)
    offsets = np.array([0, 2, 9, 14], dtype=np.int32)
    act_row = torch.randint(0, 11, (14,), generator=g, dtype=torch.int32).numpy()
    outs = []
    for rows in (kernels.mxfp4_rows, kernels.mxfp4_rows_vnni):
        out = np.full((14, out_width), np.nan, dtype=np.float32)
        rows(w, s, *act, slot_list, offsets, act_row, np.float32(0.5), out)
        outs.append(torch.from_numpy(out))
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])


def test_decode_tables_equal_the_formats():
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(torch.from_numpy(kernels.E8M0_VALUES), e8m0_to_float(codes))
    fp8 = codes.view(torch.float8_e4m3fn).float()
    got = torch.from_numpy(kernels.FP8_VALUES)
    assert torch.equal(got.isnan(), fp8.isnan())
    assert torch.equal(got[~fp8.isnan()], fp8[~fp8.isnan()])


def test_memory_is_the_stored_bytes():
    stored = _stored(quantize_mxfp4, 2, 64, 96, seed=41)
    experts = _host(HostMxfp4Experts, stored)
    assert experts.nbytes == sum(stored[p].numel() for p in PARTS)


def test_bad_input_names_the_tensor():
    stored = _stored(quantize_mxfp4, 1, 64, 32, seed=51)
    experts = HostMxfp4Experts.allocate(2, 64, 32)
    parts = [stored[p][0] for p in PARTS]
    with pytest.raises(ValueError, match="slot 1 up weight: expected shape"):
        experts.put(1, parts[0], parts[1], parts[2][:, :-1], *parts[3:])
    bad_scale = parts[5].clone()
    bad_scale[3, 0] = 255
    with pytest.raises(ValueError, match=r"slot 0 down scale.*\(3, 0\)"):
        experts.put(0, *parts[:5], bad_scale)
    with pytest.raises(IndexError, match="slot 2 out of range"):
        experts.put(2, *parts)
    experts.put(0, *parts)
    x = torch.randn(1, 64)
    with pytest.raises(IndexError, match=r"slot_ids\[0, 1\] holds 5: this layer has 2 host"):
        _forward(experts, x, torch.tensor([[0, 5]], dtype=torch.int32), torch.ones(1, 2), None)
    with pytest.raises(IndexError, match=r"slot_ids\[0, 0\] holds -2"):
        _forward(experts, x, torch.tensor([[-2]]), torch.ones(1, 1), None)
    with pytest.raises(TypeError, match="slot_ids: expected dtype torch.int32 or torch.int64"):
        _forward(experts, x, torch.tensor([[0.0]]), torch.ones(1, 1), None)
    with pytest.raises(ValueError, match=r"weights: expected shape \[1, 1\]"):
        _forward(experts, x, torch.tensor([[0]]), torch.ones(1, 2), None)
    with pytest.raises(ValueError, match="out must be contiguous"):
        ids = torch.tensor([[0], [0]])
        host_experts_forward(experts, x.repeat(2, 1), ids, torch.ones(2, 1), None,
                             torch.empty(64, 2).t())  # fmt: skip


def test_reused_tensors_are_read_afresh_at_every_call():
    # the same tensor objects at every call, as a CUDA graph's pinned buffers are: their
    # new contents are what counts
    stored = _stored(quantize_mxfp4, 3, 64, 32, seed=91)
    experts = _host(HostMxfp4Experts, stored)
    x, ids, weights = _inputs(4, 2, 3, 64, seed=92)
    out = poisoned(x.shape, torch.float32, "cpu")
    for call in range(3):
        g = torch.Generator().manual_seed(93 + call)
        x.copy_(torch.randn(x.shape, generator=g))
        ids.copy_(torch.randint(-1, 3, ids.shape, generator=g, dtype=torch.int32))
        host_experts_forward(experts, x, ids, weights, None, out)
        fresh = _forward(experts, x.clone(), ids.clone(), weights.clone(), None)
        assert torch.equal(out, fresh), call


def test_float32_decode_gives_the_formats_values_exactly():
    from kernels.formats.mxfp4 import dequantize_mxfp4

    stored = _stored(quantize_mxfp4, 2, 64, 32, seed=101)
    stored["gate_s"][1, 3, 0] = 0  # the subnormal 2^-127
    stored["up_s"][0, 5, 1] = 254  # 2^127
    experts = _host(HostMxfp4Experts, stored)
    row = np.empty(64, dtype=np.float32)
    for s in range(2):
        for name, rows_of in (("gate", range(4)), ("up", range(4, 8))):
            want = dequantize_mxfp4(stored[f"{name}_w"][s], stored[f"{name}_s"][s])  # [I, D]
            for i in range(32):
                rb, r = divmod(i, 4)
                kernels._decode_mxfp4_row(
                    experts.gate_up, experts.gate_up_scales, s, rb, rows_of[r], row
                )
                assert torch.equal(torch.from_numpy(row), want[i]), (s, name, i)


def test_the_thread_count_holds_in_every_calling_thread():
    # numba's own setting is per thread: a CUDA graph's host node calls from the driver's
    import threading

    import numba

    from kernels.cpu import host_experts

    experts = _host(HostMxfp4Experts, _stored(quantize_mxfp4, 4, 64, 96, seed=5))
    x, ids, weights = _inputs(3, 2, 4, 64, seed=6)
    seen = []

    def call():
        _forward(experts, x, ids, weights, None)
        seen.append(numba.get_num_threads())

    try:
        host_experts.set_threads(1)
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        assert seen == [1]
    finally:
        host_experts.set_threads(None)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        host_experts.set_threads(0)
