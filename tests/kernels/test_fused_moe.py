import pytest
import torch

from kernels.reference.fused_moe import fused_moe_reference
from kernels.reference.quant_formats import random_fp8_block, random_mxfp4
from kernels.triton.fused_moe import SharedExpert, fused_moe
from kernels.triton.moe_align import moe_align, moe_align_torch
from tests.kernels._helpers import DEVICE, gpu_only, rel_err


def make_moe(t, d, i, e, a, fmt, seed, scale_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(torch.bfloat16)
    logits = torch.randn(t, e, generator=g)
    topk_w, topk_ids = torch.softmax(logits, -1).topk(a, dim=-1)
    if fmt == "bf16":
        w13 = (torch.randn(e, 2 * i, d, generator=g) / d**0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, d, i, generator=g) / i**0.5).to(torch.bfloat16)
        s13 = s2 = None
    elif fmt == "fp8":
        w13, s13 = random_fp8_block((e, 2 * i, d), scale_dtype=scale_dtype, generator=g)
        w2, s2 = random_fp8_block((e, d, i), scale_dtype=scale_dtype, generator=g)
    else:
        w13, s13 = random_mxfp4((e, 2 * i, d), generator=g)
        w2, s2 = random_mxfp4((e, d, i), generator=g)
    args = [x, w13, w2, topk_w.float(), topk_ids.int()]
    args = [v.to(DEVICE) for v in args]
    kw = dict(fmt=fmt, w13_scale=s13, w2_scale=s2)
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    return args, kw


def test_moe_align_groups_every_pair_once():
    ids = torch.randint(0, 5, (7, 3), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    al = moe_align(ids, num_experts=5, block_m=4)
    flat = ids.flatten()
    real = al.sorted_pairs[al.sorted_pairs < al.num_pairs].long()
    assert sorted(real.tolist()) == list(range(21))
    tiles = al.sorted_pairs.view(-1, 4)
    for b, tile in enumerate(tiles):
        pairs = tile[tile < al.num_pairs].long()
        if al.block_expert[b] < 0:
            assert pairs.numel() == 0
        else:
            assert (flat[pairs] == al.block_expert[b]).all()


@pytest.mark.parametrize(
    "t,a,e,block_m",
    [(1, 6, 64, 16), (7, 3, 5, 4), (40, 6, 64, 16), (70, 8, 256, 64), (700, 6, 64, 64)],
)
def test_moe_align_kernel_equals_torch_twin_and_zeroes(t, a, e, block_m):
    g = torch.Generator().manual_seed(t * 7 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)]).int().to(DEVICE)
    acc = torch.randn(t, 300, generator=g).to(DEVICE)  # not zero: the launch must zero it
    al = moe_align(ids, e, block_m, zero=acc)
    ref = moe_align_torch(ids, e, block_m)
    assert torch.equal(al.sorted_pairs, ref.sorted_pairs)
    assert torch.equal(al.block_expert, ref.block_expert)
    assert bool((acc == 0).all())


def random_shared(d, i, fmt, seed):
    g = torch.Generator().manual_seed(seed)
    if fmt == "bf16":
        w13 = (torch.randn(2 * i, d, generator=g) / d**0.5).to(torch.bfloat16)
        w2 = (torch.randn(d, i, generator=g) / i**0.5).to(torch.bfloat16)
        s13 = s2 = None
    elif fmt == "fp8":
        w13, s13 = random_fp8_block((2 * i, d), generator=g)
        w2, s2 = random_fp8_block((d, i), generator=g)
    else:
        w13, s13 = random_mxfp4((2 * i, d), generator=g)
        w2, s2 = random_mxfp4((d, i), generator=g)
    move = lambda v: None if v is None else v.to(DEVICE)  # noqa: E731
    return SharedExpert(fmt, move(w13), move(w2), move(s13), move(s2))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("t", [1, 20])
def test_fused_moe_adds_the_shared_expert(fmt, t):
    args, kw = make_moe(t, d=128, i=128, e=4, a=2, fmt="bf16", seed=t)
    shared = random_shared(128, 256, fmt, seed=t + 1)
    out = fused_moe(*args, **kw, shared=shared)
    one = torch.ones(t, 1, device=DEVICE)
    zero_ids = torch.zeros(t, 1, dtype=torch.int32, device=DEVICE)
    s13 = None if shared.w13_scale is None else shared.w13_scale[None]
    s2 = None if shared.w2_scale is None else shared.w2_scale[None]
    ref_shared = fused_moe_reference(
        args[0], shared.w13[None], shared.w2[None], one, zero_ids, fmt, s13, s2
    )
    ref = fused_moe_reference(*args, **kw).float() + ref_shared.float()
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("t,a", [(1, 2), (6, 3)])
def test_fused_moe_matches_expert_loop(fmt, t, a):
    args, kw = make_moe(t, d=64, i=96, e=5, a=a, fmt=fmt, seed=t + a)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    out = fused_moe(*args, **kw, config=cfg)
    assert out.shape == args[0].shape and out.dtype == torch.bfloat16
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.parametrize("block_k", [32, 128])
def test_fused_moe_mxfp4_wide_k_steps(block_k):
    # K = 96 is not a multiple of a 128 step: its last 32-group is masked
    args, kw = make_moe(5, d=96, i=96, e=3, a=2, fmt="mxfp4", seed=block_k)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=block_k, num_warps=4, num_stages=2)
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


def test_fused_moe_fp8_e8m0_scales_and_default_config():
    args, kw = make_moe(4, d=256, i=128, e=4, a=2, fmt="fp8", seed=3, scale_dtype=torch.uint8)
    out = fused_moe(*args, **kw)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


def test_fused_moe_rejects_wrong_scale_shape():
    args, kw = make_moe(2, d=64, i=32, e=3, a=2, fmt="mxfp4", seed=1)
    kw["w2_scale"] = kw["w2_scale"][:, :-1].contiguous()
    with pytest.raises(AssertionError, match="w2 scale"):
        fused_moe(*args, **kw)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("t", [1, 8, 64, 300])
def test_fused_moe_gpu_sizes(fmt, t):
    args, kw = make_moe(t, d=2048, i=1408 if fmt != "mxfp4" else 1024, e=64, a=6, fmt=fmt, seed=t)
    out = fused_moe(*args, **kw)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2
