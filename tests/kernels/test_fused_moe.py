import pytest
import torch
import triton
import triton.language as tl

import kernels.triton.fused_moe as fused_moe_module
from kernels.reference.fused_moe import fused_moe_reference
from kernels.reference.moe_align import moe_align_reference
from kernels.reference.quant_formats import dequant_mxfp4, random_fp8_block, random_mxfp4
from kernels.triton._common import interpreting
from kernels.triton._fused_moe_kernels import (
    _mxfp4_factors,
    _mxfp4_weight_rows,
    _mxfp4_weights,
    _tile_ids,
)
from kernels.triton.fused_moe import SharedExpert, fused_moe
from kernels.triton.moe_align import moe_align
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


@pytest.mark.parametrize("twin", [False, True])
def test_moe_align_groups_every_pair_once_in_pair_order(twin):
    ids = torch.randint(0, 5, (7, 3), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    if twin:
        sorted_pairs, block_expert = moe_align_reference(ids, 5, 4)
    else:
        al = moe_align(ids, num_experts=5, block_m=4)
        sorted_pairs, block_expert = al.sorted_pairs, al.block_expert
    flat = ids.flatten()
    real = sorted_pairs[sorted_pairs < 21].long()
    assert sorted(real.tolist()) == list(range(21))
    # grouped by expert, ascending; pair order kept within an expert
    assert torch.equal(real, torch.argsort(flat.long(), stable=True))
    tiles = sorted_pairs.view(-1, 4)
    assert tiles.shape[0] == block_expert.numel() == -(-(21 + 5 * 3) // 4)
    for b, tile in enumerate(tiles):
        pairs = tile[tile < 21].long()
        if block_expert[b] < 0:
            assert pairs.numel() == 0
        else:
            assert (flat[pairs] == block_expert[b]).all()
            # the pads of a tile follow its pairs
            assert bool((tile[pairs.numel() :] == 21).all())


@pytest.mark.parametrize(
    "t,a,e,block_m",
    [
        (1, 6, 64, 16),  # one program
        (7, 3, 5, 4),
        (50, 4, 8, 2),  # one program, tiles mapped in two steps
        (40, 6, 64, 16),  # chunks in parallel (count + place launches)
        (70, 8, 256, 64),
        (128, 6, 64, 16),  # batch-128 Moonlight decode
        (333, 5, 40, 32),  # many chunks, E not a power of two
        (700, 6, 64, 64),  # from PREFIX_MIN_PAIRS: the chunk counts' prefix sums
        (1500, 8, 256, 16),  # DeepSeek-V3's 256 experts, 12,000 pairs
    ],
)
def test_moe_align_kernel_equals_torch_twin_and_zeroes(t, a, e, block_m):
    g = torch.Generator().manual_seed(t * 7 + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:a] for _ in range(t)]).int().to(DEVICE)
    acc = torch.randn(t, 300, generator=g).to(DEVICE)  # not zero: the launch must zero it
    al = moe_align(ids, e, block_m, zero=acc)
    sorted_pairs, block_expert = moe_align_reference(ids, e, block_m)
    assert torch.equal(al.sorted_pairs, sorted_pairs)
    assert torch.equal(al.block_expert, block_expert)
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


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("split", [2, 3])
def test_fused_moe_down_split_k(fmt, split):
    # I = 160 is 5 steps of 32: splits of 3/2 steps, the last one shorter
    args, kw = make_moe(3, d=64, i=160, e=4, a=2, fmt=fmt, seed=split)
    block_k = 32
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, SPLIT_K=split, num_warps=4,
               num_stages=2)  # fmt: skip
    if fmt == "fp8":
        cfg["BLOCK_K"] = 32  # divides 128
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.parametrize("block_k", [32, 128, 256])
def test_fused_moe_mxfp4_wide_k_steps(block_k):
    # K = 96 is not a multiple of a 128 or 256 step: its last groups are masked
    args, kw = make_moe(5, d=96, i=96, e=3, a=2, fmt="mxfp4", seed=block_k)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=block_k, num_warps=4, num_stages=2)
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("t,a,split", [(1, 2, 1), (7, 3, 2), (40, 2, 1)])
def test_fused_moe_swap_ab(fmt, t, a, split):
    # Weights as the MMA's row side: N = 160 and I = 96 leave partial N tiles, K = 160 a
    # partial last K step (masked groups for MXFP4), 40 tokens more rows than one tile.
    args, kw = make_moe(t, d=160, i=96, e=5, a=a, fmt=fmt, seed=t + split)
    # BLOCK_N 128 at t=7: gate+up tiles of 64 units, the second one partly past I
    cfg = dict(BLOCK_M=16, BLOCK_N=128 if t == 7 else 64, BLOCK_K=64 if fmt != "fp8" else 128,
               SPLIT_K=split, SWAP_AB=True, num_warps=4, num_stages=2)  # fmt: skip
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


class _LaunchRecorder:
    """Stands in for a Triton kernel: records each launch's keywords, runs nothing."""

    def __init__(self, kernel):
        self.arg_names, self.keywords = set(kernel.arg_names), []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.keywords.append(set(kwargs))


def test_launches_pass_only_kernel_parameters(monkeypatch):
    # The interpreter ignores unknown keyword arguments; a GPU launch raises on them.
    from kernels.triton import _fused_moe_kernels as kernels

    recorders = {}
    for name in ("moe_gate_up_kernel", "moe_down_kernel"):
        recorders[name] = _LaunchRecorder(getattr(kernels, name))
        monkeypatch.setattr(fused_moe_module, name, recorders[name])
    args, kw = make_moe(3, d=128, i=64, e=4, a=2, fmt="mxfp4", seed=1)
    shared = random_shared(128, 128, "mxfp4", seed=2)
    swap = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SWAP_AB=True, GU_SPLIT_K=2, SPLIT_K=2)
    monkeypatch.setattr(fused_moe_module, "dense_config", lambda *a, **k: dict(swap))
    for cfg in (swap, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)):
        fused_moe(*args, **kw, shared=shared, config=cfg)
    options = {"num_warps", "num_stages"}
    for rec in recorders.values():
        assert len(rec.keywords) == 4  # routed and shared launches, two configs
        assert all(k - options <= rec.arg_names for k in rec.keywords)


def test_swapped_configs_refuse_options_of_the_other_orientation():
    args, kw = make_moe(2, d=64, i=64, e=3, a=2, fmt="mxfp4", seed=1)
    with pytest.raises(AssertionError, match="GU_SPLIT_K needs SWAP_AB"):
        fused_moe(*args, **kw, config=dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GU_SPLIT_K=2))


@pytest.mark.parametrize("gu_split,split", [(1, 2), (4, 1)])
def test_fused_moe_swap_ab_fp8_e8m0_scales(gu_split, split):
    # E8M0 block scales (V4) on the swapped tiles; the up rows of the stacked [2I, D] weight
    # start mid 128-row scale block (I = 96)
    args, kw = make_moe(6, d=256, i=96, e=4, a=2, fmt="fp8", seed=gu_split,
                        scale_dtype=torch.uint8)  # fmt: skip
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SWAP_AB=True, GU_SPLIT_K=gu_split,
               SPLIT_K=split, num_warps=4, num_stages=2)  # fmt: skip
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("gu_split", [2, 4])
def test_fused_moe_gate_up_split_k(fmt, gu_split):
    # D = 192 is 3 steps of 64: splits of 2+1 steps, or 1+1+1 and one with no step at all;
    # a second call reuses the arrival counters the first one must have left at zero.
    args, kw = make_moe(5, d=192, i=96, e=4, a=2, fmt=fmt, seed=gu_split)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SWAP_AB=True, GU_SPLIT_K=gu_split,
               num_warps=4, num_stages=2)  # fmt: skip
    ref = fused_moe_reference(*args, **kw)
    for _ in range(2):
        assert rel_err(fused_moe(*args, **kw, config=cfg), ref) < 2e-2


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("down", [None, dict(BLOCK_N=32, SPLIT_K=4)])
def test_fused_moe_swap_ab_shared_expert(fmt, down, monkeypatch):
    # the shared expert's DENSE launches with a SWAP_AB, split gate+up config (what a tuned
    # table entry may hold), against the routed-only result plus the shared reference; a
    # DOWN entry gives the shared down its own tile (grid: D / BLOCK_N x SPLIT_K)
    args, kw = make_moe(3, d=128, i=64, e=4, a=2, fmt=fmt, seed=5)
    shared = random_shared(128, 128, fmt, seed=6)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SWAP_AB=True, GU_SPLIT_K=2, SPLIT_K=2,
               num_warps=4, num_stages=2)  # fmt: skip
    shared_cfg = dict(cfg, DOWN=down) if down else dict(cfg)
    monkeypatch.setattr(fused_moe_module, "dense_config", lambda *a, **k: dict(shared_cfg))
    grids = []
    real_down = fused_moe_module.moe_down_kernel

    class _Recorded:
        def __getitem__(self, grid):
            grids.append(grid)
            return real_down[grid]

    monkeypatch.setattr(fused_moe_module, "moe_down_kernel", _Recorded())
    out = fused_moe(*args, **kw, shared=shared, config=cfg)
    want = (1, 128 // 32, 4) if down else (1, 128 // 64, 2)
    assert grids[-1] == want  # the shared down runs after the routed one on one stream
    t = args[0].shape[0]
    one = torch.ones(t, 1, device=DEVICE)
    zero_ids = torch.zeros(t, 1, dtype=torch.int32, device=DEVICE)
    ref_shared = fused_moe_reference(args[0], shared.w13[None], shared.w2[None], one, zero_ids,
                                     fmt, shared.w13_scale[None], shared.w2_scale[None])  # fmt: skip
    ref = fused_moe_reference(*args, **kw).float() + ref_shared.float()
    assert rel_err(out, ref) < 2e-2


@triton.jit
def _decode_rows_kernel(b_ptr, s_ptr, w_ptr, F32_DOT: tl.constexpr, ASM: tl.constexpr):
    """codes [16, 32] (16 rows x 32 bytes = 2 groups), scales [16, 2] -> w [16, 64]."""
    r = tl.arange(0, 16)[:, None]
    b = tl.load(b_ptr + r * 32 + tl.arange(0, 32)[None, :])
    s = tl.load(s_ptr + r * 2 + tl.arange(0, 2)[None, :])
    w = _mxfp4_weight_rows(b, _mxfp4_factors(s), F32_DOT, ASM)
    tl.store(w_ptr + r * 64 + tl.arange(0, 64)[None, :], w.to(tl.float32))


@pytest.mark.parametrize("asm", [False, pytest.param(True, marks=[pytest.mark.gpu, gpu_only])])
def test_mxfp4_row_decode_is_exact_for_every_code_and_scale(asm):
    # SWAP_AB's decode: rows of bytes along K, natural K order out (low nibble first)
    codes = torch.arange(512).remainder(256).to(torch.uint8).view(16, 32)  # [n, k/2]
    scales = torch.tensor([0, 1, 60, 100, 118, 121, 127, 128] * 4, dtype=torch.uint8)
    scales = scales.view(16, 2)  # [n, group]
    w = torch.empty(16, 64, device=DEVICE)
    _decode_rows_kernel[(1,)](codes.to(DEVICE), scales.to(DEVICE), w, F32_DOT=interpreting(),
                              ASM=asm)  # fmt: skip
    assert torch.equal(w.cpu(), dequant_mxfp4(codes, scales))


@triton.jit
def _decode_kernel(b_ptr, s_ptr, lo_ptr, hi_ptr, F32_DOT: tl.constexpr, ASM: tl.constexpr):
    """codes [32, 16] (2 groups of 16 bytes x 16 rows), scales [2, 16] -> lo, hi [32, 16]."""
    g = tl.arange(0, 2)[:, None, None]
    r = tl.arange(0, 16)[None, :, None]
    n = tl.arange(0, 16)[None, None, :]
    b = tl.load(b_ptr + (g * 16 + r) * 16 + n)
    s = tl.load(s_ptr + tl.arange(0, 2)[:, None] * 16 + tl.arange(0, 16)[None, :])
    f = ((tl.minimum(s.to(tl.int32), 128) + 126) << 7).to(tl.int16)
    lo, hi = _mxfp4_weights(b, f.to(tl.bfloat16, bitcast=True)[:, None, :], F32_DOT, ASM)
    out = tl.arange(0, 32)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(lo_ptr + out, lo.to(tl.float32))
    tl.store(hi_ptr + out, hi.to(tl.float32))


@pytest.mark.parametrize("asm", [False, pytest.param(True, marks=[pytest.mark.gpu, gpu_only])])
def test_mxfp4_decode_is_exact_for_every_code_and_scale(asm):
    # Every byte value (both nibbles, all 16 codes incl. the subnormal 0.5 and -0) against
    # every kind of E8M0 scale the decode covers: 0 (2^-127, results subnormal), small,
    # 2^0 and the largest exact one, 2^1.
    codes = torch.arange(512).remainder(256).to(torch.uint8).view(32, 16)  # [k/2, n]
    scales = torch.tensor([0, 1, 60, 100, 118, 121, 127, 128] * 4, dtype=torch.uint8)
    scales = scales.view(2, 16)  # [group, n]
    lo = torch.empty(32, 16, device=DEVICE)
    hi = torch.empty(32, 16, device=DEVICE)
    _decode_kernel[(1,)](codes.to(DEVICE), scales.to(DEVICE), lo, hi,
                         F32_DOT=interpreting(), ASM=asm)  # fmt: skip
    ref = dequant_mxfp4(codes.t().contiguous(), scales.t().contiguous()).t()  # [k, n]
    assert torch.equal(lo.cpu(), ref[0::2]) and torch.equal(hi.cpu(), ref[1::2])


@pytest.mark.parametrize("act_dtype", [torch.bfloat16, torch.float16])
def test_fused_moe_mxfp4_empty_experts_and_fp16_activations(act_dtype):
    # 2 tokens x 2 of 8 experts: most experts get no pair, their tiles are skipped
    args, kw = make_moe(2, d=64, i=64, e=8, a=2, fmt="mxfp4", seed=11)
    args[0] = args[0].to(act_dtype)
    out = fused_moe(*args, **kw)
    assert out.dtype == act_dtype
    ref = fused_moe_reference(args[0].to(torch.bfloat16), *args[1:], **kw)
    assert rel_err(out, ref) < 2e-2


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
@pytest.mark.parametrize("t", [1, 8, 64, 300, 1500])
def test_fused_moe_gpu_sizes(fmt, t):
    args, kw = make_moe(t, d=2048, i=1408 if fmt != "mxfp4" else 1024, e=64, a=6, fmt=fmt, seed=t)
    out = fused_moe(*args, **kw)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("t", [1, 8, 300])
def test_fused_moe_swap_ab_gpu_sizes(fmt, t):
    # SWAP_AB at real sizes, with both D splits at few tokens (the tuned decode configs)
    args, kw = make_moe(t, d=2048, i=1408, e=64, a=6, fmt=fmt, seed=t)
    cfg = dict(BLOCK_M=16 if t <= 8 else 32, BLOCK_N=64, BLOCK_K=128 if fmt == "mxfp4" else 64,
               SWAP_AB=True, GU_SPLIT_K=4 if t <= 8 else 1, SPLIT_K=2 if t <= 8 else 1,
               num_warps=4, num_stages=3)  # fmt: skip
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("t", [1, 8, 48])
def test_fused_moe_shared_expert_on_a_side_stream(fmt, t):
    # The shared expert's launches on a second stream, concurrently with the routed ones,
    # give the one-stream result, eagerly and replayed from a CUDA graph. The routed
    # config splits gate+up along D (arrival counters); so does the shared expert's tuned
    # H200 entry at 1 and 8 tokens, which then counts in its own lane at the same time.
    args, kw = make_moe(t, d=2048, i=1408, e=64, a=6, fmt=fmt, seed=t)
    shared = random_shared(2048, 2816, "fp8", seed=t + 7)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SWAP_AB=True, GU_SPLIT_K=4, SPLIT_K=2,
               num_warps=4, num_stages=3)  # fmt: skip
    call = dict(**kw, shared=shared, config=cfg, out_dtype=torch.float32)
    ref = fused_moe(*args, **call)
    side = torch.cuda.Stream()
    eager = fused_moe(*args, **call, shared_stream=side)
    torch.cuda.current_stream().synchronize()
    assert side.query()  # the caller's stream waited for the side stream's work (the join)
    assert rel_err(eager, ref) < 1e-5  # float32 atomics: only the summation order differs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(*args, **call, shared_stream=side)
    args[0].copy_(torch.randn_like(args[0]))  # new inputs, replayed
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(captured, fused_moe(*args, **call)) < 1e-5


@pytest.mark.parametrize("with_shared", [False, True])
def test_fused_moe_dequant_config_runs_the_bf16_kernels_on_decoded_experts(with_shared):
    # "KERNEL": "dequant": the MXFP4 experts decoded to bf16 once, then the bf16 kernels
    # with the config's tile: the same result as calling them on the decoded weights
    from kernels.reference.quant_formats import dequant_mxfp4

    args, kw = make_moe(9, d=128, i=96, e=4, a=2, fmt="mxfp4", seed=13)
    shared = random_shared(128, 128, "bf16", seed=14) if with_shared else None
    tile = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=2, num_warps=4, num_stages=2)
    out = fused_moe(*args, **kw, config=dict(tile, KERNEL="dequant"), shared=shared)
    w13 = dequant_mxfp4(args[1], kw["w13_scale"]).to(torch.bfloat16)
    w2 = dequant_mxfp4(args[2], kw["w2_scale"]).to(torch.bfloat16)
    bf16 = fused_moe(args[0], w13, w2, *args[3:], fmt="bf16", config=tile, shared=shared)
    assert rel_err(out, bf16) < 1e-5  # float32 atomics: only the summation order differs
    if not with_shared:
        assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.parametrize("why", ["scratch", "fp16"])
def test_fused_moe_dequant_config_falls_back_to_the_mxfp4_kernels(why, monkeypatch):
    # a scratch over DEQUANT_MAX_BYTES, or fp16 activations (no fp16 x bf16 dot): the
    # MXFP4 kernels with the heuristic's tile
    args, kw = make_moe(5, d=64, i=64, e=3, a=2, fmt="mxfp4", seed=15)
    if why == "scratch":
        monkeypatch.setattr(fused_moe_module, "DEQUANT_MAX_BYTES", 0)
    else:
        args[0] = args[0].half()
    called = []
    monkeypatch.setattr("kernels.triton.mxfp4_dequant.dequant_mxfp4", called.append)
    cfg = dict(KERNEL="dequant", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    out = fused_moe(*args, **kw, config=cfg)
    assert not called
    ref = fused_moe_reference(args[0].bfloat16(), *args[1:], **kw)
    assert rel_err(out.float(), ref.float()) < 2e-2


def test_dequant_configs_are_for_mxfp4_experts_only():
    args, kw = make_moe(2, d=64, i=64, e=3, a=2, fmt="fp8", seed=16)
    cfg = dict(KERNEL="dequant", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)
    with pytest.raises(AssertionError, match="decodes MXFP4 experts"):
        fused_moe(*args, **kw, config=cfg)


@triton.jit
def _tile_ids_kernel(hits_ptr, GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_ids(GROUP_M)
    tl.atomic_add(hits_ptr + pid_m * tl.num_programs(1) + pid_n, 1)


@pytest.mark.parametrize("num_m,num_n,group_m", [(7, 5, 3), (12, 22, 8), (5, 3, 8), (9, 1, 4)])
def test_grouped_tile_ids_visit_every_tile_once(num_m, num_n, group_m):
    # a partial last group (7 = 3 + 3 + 1), groups larger than the grid, one column
    hits = torch.zeros(num_m * num_n, dtype=torch.int32, device=DEVICE)
    _tile_ids_kernel[(num_m, num_n)](hits, GROUP_M=group_m)
    assert torch.equal(hits.cpu(), torch.ones(num_m * num_n, dtype=torch.int32))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("swap", [False, True])
def test_fused_moe_grouped_launch_order(fmt, swap):
    # 40 tokens x 3 experts each over 5 experts: ~12 token tiles of 16 in groups of 3
    args, kw = make_moe(40, d=160, i=96, e=5, a=3, fmt=fmt, seed=23)
    cfg = dict(BLOCK_M=16, BLOCK_N=64 if swap else 32, BLOCK_K=64 if fmt != "fp8" else 128,
               SWAP_AB=swap, GROUP_M=3, num_warps=4, num_stages=2)  # fmt: skip
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_fused_moe_default_config_groups_prefill_tiles(fmt):
    # more than 64 pairs per expert: the heuristic's prefill tile, in launch-order groups
    assert fused_moe_module.default_config(6 * 4096, 64, fmt)["GROUP_M"] == 8
    assert "GROUP_M" not in fused_moe_module.default_config(6 * 8, 64, fmt)
    args, kw = make_moe(140, d=64, i=64, e=2, a=1, fmt=fmt, seed=29)
    out = fused_moe(*args, **kw)  # no table entry at these shapes: the heuristic
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
def test_fused_moe_down_launch_takes_its_own_tile(fmt):
    # a config's DOWN entry: the down launch's own N tile, K step, orientation and K split
    # (here against a gate+up in the other orientation with its own D split)
    args, kw = make_moe(5, d=160, i=96, e=4, a=2, fmt=fmt, seed=17)
    block_k = 64 if fmt != "fp8" else 128
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, SWAP_AB=True, GU_SPLIT_K=2,
               num_warps=4, num_stages=2,
               DOWN=dict(BLOCK_N=32, BLOCK_K=32, SWAP_AB=False, SPLIT_K=3))  # fmt: skip
    out = fused_moe(*args, **kw, config=cfg)
    assert rel_err(out, fused_moe_reference(*args, **kw)) < 2e-2


def test_down_overrides_are_checked():
    args, kw = make_moe(2, d=64, i=96, e=4, a=2, fmt="bf16", seed=18)
    base = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    with pytest.raises(AssertionError, match="DOWN may set"):
        fused_moe(*args, **kw, config=dict(base, DOWN=dict(BLOCK_M=32)))
    with pytest.raises(AssertionError, match="FP8 needs BLOCK_K"):  # the merged config too
        fused_moe_module._check_config(dict(base, BLOCK_K=128, DOWN=dict(BLOCK_K=96)), "fp8")
