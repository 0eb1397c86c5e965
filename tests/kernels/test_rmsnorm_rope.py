import pytest
import torch

from kernels.reference.mla_cache import mla_decode_prologue_reference, mla_rope_cache_reference
from kernels.reference.rmsnorm import rmsnorm_reference
from kernels.reference.rope import rope_reference
from kernels.triton.mla_cache import ABSORB_MAX_TOKENS, mla_decode_prologue_, mla_rope_cache_write_
from kernels.triton.rmsnorm import rmsnorm
from kernels.triton.rope import apply_rope_
from tests.kernels._helpers import DEVICE, gpu_only, rel_err


@pytest.mark.parametrize("rows,d", [(3, 64), (5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(rows, d, with_residual):
    g = torch.Generator().manual_seed(rows * d)
    x = torch.randn(rows, d, generator=g).bfloat16().to(DEVICE)
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16().to(DEVICE)
    res = torch.randn(rows, d, generator=g).bfloat16().to(DEVICE) if with_residual else None
    out = rmsnorm(x, w, 1e-6, res)
    ref = rmsnorm_reference(x, w, 1e-6, res)
    if with_residual:
        # Exact on a GPU; the interpreter truncates float32 -> bf16 instead of rounding.
        if DEVICE == "cuda":
            assert torch.equal(out[1], ref[1])
        assert rel_err(out[1], ref[1]) < 1e-2
        out, ref = out[0], ref[0]
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("rows,d", [(1, 64), (4, 100)])
def test_rmsnorm_adds_a_float32_x_into_a_bf16_residual(rows, d):
    # The MoE's float32 accumulator as x: one rounding of x + residual, outputs bf16.
    g = torch.Generator().manual_seed(rows + d)
    x = torch.randn(rows, d, generator=g).to(DEVICE)
    w = (1 + 0.1 * torch.randn(d, generator=g)).bfloat16().to(DEVICE)
    res = torch.randn(rows, d, generator=g).bfloat16().to(DEVICE)
    y, r = rmsnorm(x, w, 1e-6, res)
    y_ref, r_ref = rmsnorm_reference(x, w, 1e-6, res)
    assert y.dtype == r.dtype == torch.bfloat16
    if DEVICE == "cuda":  # the interpreter truncates float32 -> bf16 instead of rounding
        assert torch.equal(r, r_ref)
    assert rel_err(r, r_ref) < 1e-2 and rel_err(y, y_ref) < 1e-2


def _rope_case(t, h, r, seed):
    g = torch.Generator().manual_seed(seed)
    q_full = torch.randn(t, h, 16 + r, generator=g).bfloat16().to(DEVICE)
    k = torch.randn(t, 1, r, generator=g).bfloat16().to(DEVICE)
    pos = torch.randint(0, 50, (t,), generator=g).to(DEVICE)
    ang = torch.rand(50, r // 2, generator=g) * 6.28
    return q_full, k, pos, ang.cos().to(DEVICE), ang.sin().to(DEVICE)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("t,h,r", [(3, 4, 16), (2, 3, 8)])
def test_rope_in_place_on_a_slice(interleaved, t, h, r):
    q_full, k, pos, cos, sin = _rope_case(t, h, r, seed=t * h + r)
    q = q_full[..., 16:]  # rope part of a wider query, like MLA's [nope | rope]
    q_ref = rope_reference(q, pos, cos, sin, interleaved)
    k_ref = rope_reference(k, pos, cos, sin, interleaved)
    nope_before = q_full[..., :16].clone()
    apply_rope_(q, k, pos, cos, sin, interleaved)
    assert torch.equal(q_full[..., :16], nope_before)
    assert rel_err(q, q_ref) < 1e-2 and rel_err(k, k_ref) < 1e-2


def _assert_cache_equal(cache, want):
    """The same slots written (NaN elsewhere), their values within bf16 rounding (exact on
    a GPU; the interpreter truncates float32 -> bf16 instead of rounding)."""
    assert torch.equal(cache.isnan(), want.isnan())
    written = ~want.isnan()
    if DEVICE == "cuda":
        assert torch.equal(cache[written], want[written])
    assert rel_err(cache[written], want[written]) < 1e-2


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("t,h,kvl,r", [(3, 4, 32, 16), (2, 16, 512, 64)])
def test_mla_rope_cache_write_matches_its_torch_twin(interleaved, t, h, kvl, r):
    q_full, _, pos, cos, sin = _rope_case(t, h, r, seed=t + kvl)
    g = torch.Generator().manual_seed(kvl)
    kv = torch.randn(t, kvl + r, generator=g).bfloat16().to(DEVICE)
    w = (1 + 0.1 * torch.randn(kvl, generator=g)).bfloat16().to(DEVICE)
    cache = torch.full((4, 8, kvl + r), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    slots = torch.randperm(32, generator=g)[:t].to(DEVICE)
    q = q_full[..., 16:]
    args = (kv, pos, cos, sin, interleaved, w, 1e-6)
    q_ref, cache_ref = mla_rope_cache_reference(q, *args, cache.view(-1, kvl + r), slots)
    kv_before, nope_before = kv.clone(), q_full[..., :16].clone()
    mla_rope_cache_write_(q, *args, cache.view(-1, kvl + r), slots)
    assert rel_err(q, q_ref) < 1e-2
    assert torch.equal(q_full[..., :16], nope_before) and torch.equal(kv, kv_before)
    _assert_cache_equal(cache.view(-1, kvl + r), cache_ref)


def test_mla_cache_twin_is_norm_and_rope_of_the_entry():
    # The twin itself: the entry is [rmsnorm(c) | rope(k_rot)] at the token's slot, other
    # slots untouched, whatever order the slots come in.
    t, kvl, r = 3, 32, 16
    q_full, _, pos, cos, sin = _rope_case(t, 2, r, seed=5)
    g = torch.Generator().manual_seed(6)
    kv = torch.randn(t, kvl + r, generator=g).bfloat16().to(DEVICE)
    w = (1 + 0.1 * torch.randn(kvl, generator=g)).bfloat16().to(DEVICE)
    cache = torch.zeros(10, kvl + r, dtype=torch.bfloat16, device=DEVICE)
    slots = torch.tensor([7, 2, 4], device=DEVICE)
    _, out = mla_rope_cache_reference(q_full[..., 16:], kv, pos, cos, sin, True, w, 1e-6,
                                      cache, slots)  # fmt: skip
    for i, slot in enumerate(slots.tolist()):
        c = kv[i, :kvl].float()
        normed = (c / (c.pow(2).mean() + 1e-6).sqrt() * w.float()).bfloat16()
        a, b = kv[i, kvl::2].float(), kv[i, kvl + 1 :: 2].float()
        c_, s_ = cos[pos[i]], sin[pos[i]]
        roped = torch.stack((a * c_ - b * s_, a * s_ + b * c_), -1).flatten().bfloat16()
        assert torch.equal(out[slot], torch.cat((normed, roped)))
    assert not out[[0, 1, 3, 5, 6, 8, 9]].any()


@pytest.mark.parametrize("t,h,nope,kvl", [(1, 2, 32, 64), (3, 3, 24, 96), (17, 2, 16, 32)])
def test_mla_decode_prologue_matches_its_torch_twin(t, h, nope, kvl):
    # Beside the rope and the cache entry (as mla_rope_cache_write_), q_c = q_nope @ w_uk
    # per head, as the batched GEMM it replaces computes it. 17 tokens: two 16-token dots;
    # nope 24: a masked dot; kvl 96: a partial latent block.
    r = 16
    g = torch.Generator().manual_seed(t * 100 + nope)
    q = torch.randn(t, h, nope + r, generator=g).bfloat16().to(DEVICE)
    kv = torch.randn(t, kvl + r, generator=g).bfloat16().to(DEVICE)
    w = (1 + 0.1 * torch.randn(kvl, generator=g)).bfloat16().to(DEVICE)
    w_uk = torch.randn(h, nope, kvl, generator=g).bfloat16().to(DEVICE)
    pos = torch.randint(0, 50, (t,), generator=g).to(DEVICE)
    ang = torch.rand(50, r // 2, generator=g) * 6.28
    cos, sin = ang.cos().to(DEVICE), ang.sin().to(DEVICE)
    cache = torch.full((4, 8, kvl + r), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    slots = torch.randperm(32, generator=g)[:t].to(DEVICE)
    args = (kv, pos, cos, sin, True, w, 1e-6)
    q_ref, cache_ref, qc_ref = mla_decode_prologue_reference(
        q, r, *args, cache.view(-1, kvl + r), slots, w_uk
    )
    q_c = mla_decode_prologue_(q, r, *args, cache.view(-1, kvl + r), slots, w_uk)
    assert q_c.shape == (t, h, kvl) and q_c.dtype == cache.dtype
    assert rel_err(q_c, qc_ref) < 1e-2
    assert rel_err(q, q_ref) < 1e-2  # the rope slice rotated in place, the nope slice kept
    assert torch.equal(q[..., :nope], q_ref[..., :nope])
    _assert_cache_equal(cache.view(-1, kvl + r), cache_ref)


def test_mla_decode_prologue_refuses_prefill_sized_batches():
    t = ABSORB_MAX_TOKENS + 1
    q = torch.zeros(t, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(t, 48, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(AssertionError, match="absorb above"):
        mla_decode_prologue_(q, 16, kv, torch.zeros(t, dtype=torch.long, device=DEVICE),
                             torch.ones(4, 8, device=DEVICE), torch.zeros(4, 8, device=DEVICE),
                             True, torch.ones(32, dtype=torch.bfloat16, device=DEVICE), 1e-6,
                             torch.zeros(64, 48, dtype=torch.bfloat16, device=DEVICE),
                             torch.arange(t, device=DEVICE), torch.zeros(2, 16, 32,
                             dtype=torch.bfloat16, device=DEVICE))  # fmt: skip


@pytest.mark.gpu
@gpu_only
def test_rmsnorm_rope_gpu_sizes():
    x = torch.randn(300, 7168, device=DEVICE).bfloat16()
    res = torch.randn_like(x)
    w = torch.rand(7168, device=DEVICE).bfloat16()
    y, r = rmsnorm(x, w, 1e-6, res)
    y_ref, r_ref = rmsnorm_reference(x, w, 1e-6, res)
    assert torch.equal(r, r_ref) and rel_err(y, y_ref) < 1e-2
    q_full, k, pos, cos, sin = _rope_case(300, 128, 64, seed=0)
    q = q_full[..., 16:]
    q_ref = rope_reference(q, pos, cos, sin, True)
    apply_rope_(q, k, pos, cos, sin, True)
    assert rel_err(q, q_ref) < 1e-2
