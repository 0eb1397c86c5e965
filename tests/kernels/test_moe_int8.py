"""The fused MoE's int8 path for MXFP4 experts (kernels/triton/_moe_int8_kernels.py): the
integer decode, dp4a and activation quantization each against a plain reference, then
whole MoE calls against the float reference. Under the interpreter the plain-integer
decode and dp4a run; on a GPU the PTX ones too, and must give the same bits."""

import pytest
import torch
import triton
import triton.language as tl

import kernels.triton.fused_moe as fused_moe_module
from kernels.reference.fused_moe import fused_moe_reference
from kernels.reference.moe_int8 import act_quant_int8_reference
from kernels.triton._common import interpreting
from kernels.triton._moe_int8_kernels import decode_e2m1_int8, dp4a, quantize_int8_words
from kernels.triton.fused_moe import fused_moe
from tests.kernels._helpers import DEVICE, gpu_only, rel_err
from tests.kernels.test_fused_moe import _LaunchRecorder, make_moe, random_shared

E2M1_X2 = [0, 1, 2, 3, 4, 6, 8, 12]
ASM_CHOICES = [False] if interpreting() else [False, True]


def _int8_of_nibble(n: int) -> int:
    return (-1 if n & 8 else 1) * E2M1_X2[n & 7]


@triton.jit
def _decode_kernel(q_ptr, lo_ptr, hi_ptr, ASM: tl.constexpr):
    offs = tl.arange(0, 1024)
    lo, hi = decode_e2m1_int8(tl.load(q_ptr + offs), ASM)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


@pytest.mark.parametrize("asm", ASM_CHOICES)
def test_decode_gives_e2m1_times_two_for_every_nibble_in_every_place(asm):
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-(2**31), 2**31 - 1, (1024,), generator=g, dtype=torch.int64)
    q[:256] = torch.arange(256) * 0x01010101 - (torch.arange(256) >= 128).long() * 2**32
    q = q.to(torch.int32)
    lo, hi = (torch.empty(1024, dtype=torch.int32, device=DEVICE) for _ in range(2))
    _decode_kernel[(1,)](q.to(DEVICE), lo, hi, ASM=asm)
    got = torch.cat([lo.cpu()[:, None], hi.cpu()[:, None]], 1).view(torch.int8).view(-1, 8)
    nibbles = [(q.long() >> (4 * j)) & 0xF for j in range(8)]
    want = torch.stack([n.apply_(_int8_of_nibble) for n in nibbles], 1)
    assert torch.equal(got.long(), want)


@triton.jit
def _dp4a_kernel(a_ptr, b_ptr, c_ptr, out_ptr, ASM: tl.constexpr):
    offs = tl.arange(0, 256)
    out = dp4a(tl.load(a_ptr + offs), tl.load(b_ptr + offs), tl.load(c_ptr + offs), ASM)
    tl.store(out_ptr + offs, out)


@pytest.mark.parametrize("asm", ASM_CHOICES)
def test_dp4a_adds_the_dot_of_four_signed_bytes(asm):
    g = torch.Generator().manual_seed(1)
    a8 = torch.randint(-128, 128, (256, 4), generator=g, dtype=torch.int8)
    b8 = torch.randint(-128, 128, (256, 4), generator=g, dtype=torch.int8)
    a8[0], b8[0] = -128, -128  # the extremes
    c = torch.randint(-(2**20), 2**20, (256,), generator=g, dtype=torch.int32)
    out = torch.empty_like(c).to(DEVICE)
    _dp4a_kernel[(1,)](a8.view(torch.int32).view(-1).to(DEVICE),
                       b8.view(torch.int32).view(-1).to(DEVICE), c.to(DEVICE), out, ASM=asm)  # fmt: skip
    want = c + (a8.int() * b8.int()).sum(1)
    assert torch.equal(out.cpu(), want)


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M: tl.constexpr, K: tl.constexpr):
    rows, cols = tl.arange(0, M), tl.arange(0, K)
    words, scale = quantize_int8_words(tl.load(x_ptr + rows[:, None] * K + cols[None, :]), M, K)
    tl.store(q_ptr + rows[:, None] * (K // 4) + tl.arange(0, K // 4)[None, :], words)
    tl.store(s_ptr + rows[:, None] * (K // 32) + tl.arange(0, K // 32)[None, :], scale)


def test_activation_quantization_matches_its_torch_twin():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 128, generator=g) * torch.logspace(-3, 3, 4)[:, None]
    x[1, 32:64] = 0.0  # an all-zero block: scale tiny, codes zero, no NaN
    x[2, :3] = torch.tensor([127.0, 63.5, -63.5]) / 8  # step 1/8: codes 63.5 tie away
    x[2, 3:32] = x[2, 3:32].clamp(-1, 1) / 8
    q = torch.empty(4, 32, dtype=torch.int32, device=DEVICE)
    s = torch.empty(4, 4, device=DEVICE)
    _quantize_kernel[(1,)](x.to(DEVICE), q, s, M=4, K=128)
    q_ref, s_ref = act_quant_int8_reference(x)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    # the twin itself: codes x / step rounded, step = amax / 127, packed 4 bytes to a word
    blocks = x.view(4, 4, 32)
    step = blocks.abs().amax(-1).clamp_min(1e-30) / 127
    codes = q_ref.view(torch.int8).view(4, 4, 32).float()
    assert ((codes - blocks / step[..., None]).abs() <= 0.5).all()
    assert torch.equal(s_ref, step / 2)
    assert codes[2, 0, :3].tolist() == [127.0, 64.0, -64.0]
    b = [int(c) & 0xFF for c in codes[0, 0, :4]]  # element 4j + i in byte i of word j
    word = b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24
    assert q_ref[0, 0].item() == (word - (1 << 32) if word >= 1 << 31 else word)


INT8 = dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=32, BLOCK_K=64, num_warps=4)


@pytest.mark.parametrize("t,a,e", [(1, 2, 5), (4, 3, 5), (7, 2, 3)])
@pytest.mark.parametrize("block_n,block_k", [(32, 64), (64, 256), (128, 64)])
def test_int8_moe_matches_the_float_reference(t, a, e, block_n, block_k):
    # D = 160: a partial K step at both block_k and a partial row tile of the down at 64
    # and 128; I = 96: a partial unit tile of gate+up at 64 and 128; e = 3 with 7 tokens:
    # experts with several pairs (several single-pair tiles each)
    args, kw = make_moe(t, d=160, i=96, e=e, a=a, fmt="mxfp4", seed=t * 10 + a)
    out = fused_moe(*args, **kw, config=dict(INT8, BLOCK_N=block_n, BLOCK_K=block_k))
    # int8 activations per 32 (x, then h): ~1% against exact bf16 activations
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 3e-2


@pytest.mark.parametrize("block_n,block_k", [(32, 64), (64, 256)])
def test_int8_moe_without_prefetch_matches_the_float_reference(block_n, block_k):
    # PREFETCH False: each tile loaded just before its math (partial K steps, as above)
    args, kw = make_moe(7, d=160, i=96, e=3, a=2, fmt="mxfp4", seed=72)
    cfg = dict(INT8, BLOCK_N=block_n, BLOCK_K=block_k, PREFETCH=False)
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 3e-2
    # and the same sums as with it: only the order of the loads differs
    prefetched = fused_moe(*args, **kw, config=dict(cfg, PREFETCH=True))
    torch.testing.assert_close(out, prefetched, rtol=0, atol=0)


def test_int8_down_launch_takes_its_own_tile():
    # DOWN: the down launch's own row tile, K step and warps (gate+up keeps 32 x 64)
    args, kw = make_moe(4, d=160, i=96, e=5, a=3, fmt="mxfp4", seed=41)
    cfg = dict(INT8, DOWN=dict(BLOCK_N=128, BLOCK_K=32, num_warps=8))
    assert rel_err(fused_moe(*args, **kw, config=cfg), fused_moe_reference(*args, **kw)) < 3e-2
    with pytest.raises(AssertionError, match="DOWN may set"):
        fused_moe(*args, **kw, config=dict(INT8, DOWN=dict(SPLIT_K=2)))


def test_int8_moe_with_the_shared_expert_and_float32_out():
    args, kw = make_moe(3, d=128, i=64, e=4, a=2, fmt="mxfp4", seed=4)
    shared = random_shared(128, 64, "fp8", seed=5)
    out = fused_moe(*args, **kw, config=INT8, shared=shared, out_dtype=torch.float32)
    want = fused_moe_reference(*args, **kw).float() + fused_moe(
        args[0], shared.w13[None], shared.w2[None], torch.ones(3, 1, device=DEVICE),
        torch.zeros(3, 1, dtype=torch.int32, device=DEVICE), fmt="fp8",
        w13_scale=shared.w13_scale[None], w2_scale=shared.w2_scale[None],
    ).float()  # fmt: skip
    assert out.dtype == torch.float32 and rel_err(out, want) < 3e-2


def test_a_nan_activation_reaches_its_tokens_output_only():
    # int8 codes cannot hold a NaN; the block's scale carries it, as the MMA path would
    args, kw = make_moe(3, d=128, i=64, e=4, a=2, fmt="mxfp4", seed=6)
    args[0][1, 70] = float("nan")
    out = fused_moe(*args, **kw, config=INT8).float()
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


def test_int8_configs_are_checked():
    args, kw = make_moe(2, d=64, i=64, e=3, a=2, fmt="mxfp4", seed=1)
    for bad, match in ((dict(INT8, BLOCK_M=2), "one pair per tile"),
                       (dict(INT8, BLOCK_N=16), "multiple of 32"),
                       (dict(INT8, BLOCK_N=96), "power of 2"),
                       (dict(INT8, SWAP_AB=True), "do not apply")):  # fmt: skip
        with pytest.raises(AssertionError, match=match):
            fused_moe(*args, **kw, config=bad)
    bf16_args, bf16_kw = make_moe(2, d=64, i=64, e=3, a=2, fmt="bf16", seed=1)
    with pytest.raises(AssertionError, match="MXFP4 experts"):
        fused_moe(*bf16_args, **bf16_kw, config=INT8)


def test_int8_launches_pass_only_kernel_parameters(monkeypatch):
    # The interpreter ignores unknown keyword arguments; a GPU launch raises on them.
    from kernels.triton import _moe_int8_kernels as kernels

    names = ("act_quant_int8_kernel", "moe_gate_up_int8_kernel", "moe_down_int8_kernel")
    recorders = {n: _LaunchRecorder(getattr(kernels, n)) for n in names}
    for name, rec in recorders.items():
        monkeypatch.setattr(fused_moe_module, name, rec)
    args, kw = make_moe(3, d=128, i=64, e=4, a=2, fmt="mxfp4", seed=1)
    fused_moe(*args, **kw, config=INT8)
    for rec in recorders.values():
        assert len(rec.keywords) == 1
        assert all(k - {"num_warps"} <= rec.arg_names for k in rec.keywords)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("t", [1, 4])
def test_int8_moe_gpu_moonlight_shape_and_ptx_equals_plain_integers(t):
    args, kw = make_moe(t, d=2048, i=1408, e=64, a=6, fmt="mxfp4", seed=t)
    cfg = dict(INT8, BLOCK_N=64, BLOCK_K=256)
    out = fused_moe(*args, **kw, config=cfg, out_dtype=torch.float32)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 3e-2
    # The PTX table decode and dp4a against the same integer arithmetic written out: equal
    # integer dots, so equal up to the order of the combine's float32 atomics.
    plain = fused_moe(*args, **kw, config=dict(cfg, INT8_ASM=False), out_dtype=torch.float32)
    assert rel_err(out, plain) < 1e-6
