"""moe_prologue's one launch must give what its torch twin gives (kernels/reference/
moe_prologue.py: the routing, the grouping, the int8 quantization of x and a zeroed
accumulator), the very bits of its separate launches (moe_gate_route, moe_align, the int8
path's quantization), and fused_moe the same result with it as without."""

import pytest
import torch

import kernels.triton.moe_prologue as prologue_module
from kernels.reference.moe_prologue import moe_prologue_reference
from kernels.reference.moe_router import moe_route_reference
from kernels.triton.fused_moe import _act_quant_int8, fused_moe, start_shared_expert
from kernels.triton.moe_align import moe_align
from kernels.triton.moe_prologue import PROLOGUE_MAX_TOKENS, moe_prologue
from kernels.triton.moe_router import moe_gate_route
from tests.kernels._helpers import DEVICE, gpu_only, rel_err
from tests.kernels.test_fused_moe import _LaunchRecorder, make_moe, random_shared

# (T, D, E, top_k, n_group, topk_group, scoring, bias, block_m, int8). T = 1: the experts
# split over programs; 16 = PROLOGUE_MAX_TOKENS with several tokens' last blocks racing to
# group; E = 12 and D = 96: blocks and quantization columns with masked tails; E = 256
# in 8 groups, 4 kept, top-8: DeepSeek-V3's routing.
CASES = [
    (1, 64, 8, 2, 1, 1, "sigmoid", True, 1, True),
    (1, 64, 8, 3, 1, 1, "sigmoid", True, 16, False),  # one token, 16-row tiles: a tile each
    (3, 96, 12, 3, 3, 2, "sigmoid", True, 16, False),
    (5, 128, 16, 4, 1, 1, "sqrtsoftplus", True, 1, True),
    (16, 64, 10, 3, 1, 1, "softmax", False, 4, False),
    (2, 64, 256, 8, 8, 4, "sigmoid", True, 16, False),  # DeepSeek-V3's routing: 8 groups
]


def _poisoned_empty(real_empty):
    """torch.empty whose floats are NaN and ints -7: an element the launch leaves unwritten
    (or an accumulator it fails to zero) shows."""

    def empty(*shape, dtype=None, device=None, **kw):
        out = real_empty(*shape, dtype=dtype, device=device, **kw)
        return out.fill_(float("nan") if out.is_floating_point() else -7)

    return empty


def _routing(e, k, ng, tg, scoring, with_bias, g):
    bias = (0.3 * torch.randn(e, generator=g)).to(DEVICE) if with_bias else None
    return dict(top_k=k, bias=bias, n_group=ng, topk_group=tg, norm_topk_prob=True,
                routed_scaling_factor=2.5, scoring=scoring)  # fmt: skip


def _check_alignment(got, ids, e, block_m):
    """The twin's grouping of the launch's ids (moe_align's, or with a tile per pair the
    pairs in their own order, each followed by its tile's pads)."""
    p = ids.numel()
    assert got.num_pairs == p and got.block_m == block_m
    want = moe_prologue_reference(torch.zeros(ids.shape[0], 32, device=ids.device),
                                  torch.zeros(e, 32, device=ids.device), ids.shape[1],
                                  block_m, False, topk_ids=ids)  # fmt: skip
    assert torch.equal(got.sorted_pairs, want.sorted_pairs)
    assert torch.equal(got.block_expert, want.block_expert)


@pytest.mark.parametrize("case", CASES)
def test_prologue_matches_its_torch_twin(case, monkeypatch):
    t, d, e, k, ng, tg, scoring, with_bias, block_m, int8 = case
    g = torch.Generator().manual_seed(t * 31 + e)
    x = torch.randn(t, d, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(e, d, generator=g) / d**0.5).to(DEVICE)
    routing = _routing(e, k, ng, tg, scoring, with_bias, g)
    # Precondition: float64 logits pick the twin's ids, so a near tie (float32 sums in
    # another order) shows up as a bad seed, not as a kernel bug.
    logits64 = (x.double() @ w.double().t()).float()
    ids64 = moe_route_reference(logits64, **routing)[1]
    monkeypatch.setattr(prologue_module.torch, "empty", _poisoned_empty(torch.empty))
    got = moe_prologue(x, w, block_m=block_m, quantize_int8=int8, **routing)
    monkeypatch.undo()
    want = moe_prologue_reference(x, w, block_m=block_m, quantize_int8=int8, **routing)
    assert torch.equal(want.topk_ids, ids64), "near tie: pick a seed"
    assert torch.equal(got.topk_ids.long(), want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.alignment.sorted_pairs, want.sorted_pairs)
    assert torch.equal(got.alignment.block_expert, want.block_expert)
    assert torch.equal(got.acc, want.acc)
    if int8:
        assert torch.equal(got.x_int8[0], want.x_int8[0])
        assert torch.equal(got.x_int8[1], want.x_int8[1])
    else:
        assert got.x_int8 is None


@pytest.mark.parametrize("case", CASES)
def test_prologue_equals_the_separate_launches(case):
    t, d, e, k, ng, tg, scoring, with_bias, block_m, int8 = case
    g = torch.Generator().manual_seed(t * 31 + e)
    x = torch.randn(t, d, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(e, d, generator=g) / d**0.5).to(DEVICE)
    routing = _routing(e, k, ng, tg, scoring, with_bias, g)
    got = moe_prologue(x, w, block_m=block_m, quantize_int8=int8, **routing)
    weights, ids = moe_gate_route(x, w, **routing)
    # the same float32 GEMV and routing code: the same bits
    assert torch.equal(got.topk_ids, ids) and torch.equal(got.topk_weights, weights)
    if block_m > 1 and t > 1:
        al = moe_align(ids, e, block_m)
        assert torch.equal(got.alignment.sorted_pairs, al.sorted_pairs)
        assert torch.equal(got.alignment.block_expert, al.block_expert)
    if int8:
        xq, xs = _act_quant_int8(x)
        assert torch.equal(got.x_int8[0], xq) and torch.equal(got.x_int8[1], xs)


@pytest.mark.parametrize("fmt,config", [
    ("mxfp4", dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=32, BLOCK_K=64, num_warps=4)),
    ("bf16", dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)),
])  # fmt: skip
@pytest.mark.parametrize("t", [1, 3])  # one token: a tile per pair at any BLOCK_M
def test_fused_moe_with_the_prologue_equals_without(fmt, config, t):
    d, i, e, k = 128, 64, 6, 2
    args, kw = make_moe(t, d=d, i=i, e=e, a=k, fmt=fmt, seed=9)
    x = args[0]
    g = torch.Generator().manual_seed(3)
    gate = (torch.randn(e, d, generator=g) / d**0.5).to(DEVICE)
    routing = _routing(e, k, 1, 1, "sigmoid", True, g)
    pro = moe_prologue(x, gate, block_m=config["BLOCK_M"],
                       quantize_int8=config.get("KERNEL") == "int8", **routing)  # fmt: skip
    shared = random_shared(d, 64, "fp8", seed=4)
    ids, weights = pro.topk_ids, pro.topk_weights
    common = dict(kw, config=config, shared=shared, out_dtype=torch.float32)
    got = fused_moe(x, args[1], args[2], weights, ids, **common, prologue=pro)
    want = fused_moe(x, args[1], args[2], weights, ids, **common)
    assert got.data_ptr() == pro.acc.data_ptr()  # the prologue's accumulator is the result
    assert rel_err(got, want) < 1e-6


def test_a_prologue_for_another_config_is_refused():
    args, kw = make_moe(2, d=64, i=64, e=4, a=2, fmt="mxfp4", seed=1)
    gate = torch.randn(4, 64).to(DEVICE)
    pro = moe_prologue(args[0], gate, top_k=2, block_m=16, quantize_int8=False)
    int8 = dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=32, BLOCK_K=64)
    with pytest.raises(AssertionError, match="another config"):
        fused_moe(args[0], args[1], args[2], pro.topk_weights, pro.topk_ids, **kw,
                  config=int8, prologue=pro)  # fmt: skip


def test_prologue_refuses_more_than_its_token_limit():
    x = torch.zeros(PROLOGUE_MAX_TOKENS + 1, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(AssertionError, match="tokens"):
        moe_prologue(x, torch.zeros(8, 64, device=DEVICE), top_k=2, block_m=1,
                     quantize_int8=True)  # fmt: skip


def test_prologue_launch_passes_only_kernel_parameters(monkeypatch):
    # The interpreter ignores unknown keyword arguments; a GPU launch raises on them.
    rec = _LaunchRecorder(prologue_module.moe_prologue_kernel)
    monkeypatch.setattr(prologue_module, "moe_prologue_kernel", rec)
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    moe_prologue(x, torch.zeros(8, 64, device=DEVICE), top_k=2, block_m=1, quantize_int8=True,
                 bias=torch.zeros(8, device=DEVICE))  # fmt: skip
    assert len(rec.keywords) == 1 and rec.keywords[0] - {"num_warps"} <= rec.arg_names


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("t", [1, 8, 16])
@pytest.mark.parametrize("block_m", [1, 16])
def test_prologue_gpu_moonlight_shape(t, block_m):
    g = torch.Generator().manual_seed(t)
    x = torch.randn(t, 2048, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(64, 2048, generator=g) / 45).to(DEVICE)
    routing = _routing(64, 6, 1, 1, "sigmoid", True, g)
    for _ in range(3):  # counters left at zero: repeated launches agree
        got = moe_prologue(x, w, block_m=block_m, quantize_int8=block_m == 1, **routing)
        weights, ids = moe_gate_route(x, w, **routing)
        assert torch.equal(got.topk_ids, ids) and torch.equal(got.topk_weights, weights)
        _check_alignment(got.alignment, ids, 64, block_m)
        if block_m == 1:
            xq, xs = _act_quant_int8(x)
            assert torch.equal(got.x_int8[0], xq) and torch.equal(got.x_int8[1], xs)
        assert not got.acc.any()


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("t", [1, 8])
def test_shared_expert_started_before_the_prologue(t):
    # As the engine runs a decode-sized MoE: the shared expert's gate+up forks onto its
    # stream before the prologue launch, its down joins the prologue's accumulator. Equal
    # to the one-stream result, eagerly and replayed from a CUDA graph with new inputs.
    args, kw = make_moe(t, d=2048, i=1408, e=64, a=6, fmt="mxfp4", seed=t)
    x, w13, w2 = args[:3]
    g = torch.Generator().manual_seed(t)
    gate = (torch.randn(64, 2048, generator=g) / 45).to(DEVICE)
    routing = _routing(64, 6, 1, 1, "sigmoid", True, g)
    shared = random_shared(2048, 2816, "fp8", seed=t + 7)
    cfg = dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=64, BLOCK_K=256, num_warps=4)
    side = torch.cuda.Stream()

    def two_streams():
        pending = start_shared_expert(x, shared, side)
        try:
            pro = moe_prologue(x, gate, block_m=1, quantize_int8=True, **routing)
            return fused_moe(x, w13, w2, pro.topk_weights, pro.topk_ids, **kw, config=cfg,
                             shared=pending, prologue=pro, out_dtype=torch.float32)  # fmt: skip
        finally:
            pending.join()

    def one_stream():
        weights, ids = moe_gate_route(x, gate, **routing)
        return fused_moe(x, w13, w2, weights, ids, **kw, config=cfg, shared=shared,
                         out_dtype=torch.float32)  # fmt: skip

    eager = two_streams()
    torch.cuda.current_stream().synchronize()
    assert side.query()  # joined: the caller's stream waited for the side stream
    assert rel_err(eager, one_stream()) < 1e-5  # float32 atomics: only the order differs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = two_streams()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(captured, one_stream()) < 1e-5
