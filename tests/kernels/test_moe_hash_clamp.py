"""DeepSeek-V4's two MoE additions on the Triton kernels, against their torch twins:
hash routing (ids = tid2eid[token], weights from the scores of those experts:
moe_hash_route_reference) in the router over logits, the router with the gate GEMV and
the decode prologue; and the SwiGLU clamp (min(gate, limit), up within [-limit, limit])
in the fused MoE's gate+up epilogue, routed and shared, in every orientation and combine."""

import pytest
import torch

import kernels.triton.moe_prologue as prologue_module
from kernels.reference.fused_moe import fused_moe_reference
from kernels.reference.moe_prologue import moe_prologue_reference
from kernels.reference.moe_router import moe_hash_route_reference, moe_route_reference
from kernels.triton.fused_moe import SharedExpert, choose_config, fixed_config, fused_moe
from kernels.triton.moe_prologue import moe_prologue
from kernels.triton.moe_router import moe_gate_route, moe_route
from tests.kernels._helpers import DEVICE, gpu_only, rel_err
from tests.kernels.test_fused_moe import make_moe, random_shared
from tests.kernels.test_moe_prologue import _poisoned_empty


def hash_table(vocab: int, e: int, k: int, g: torch.Generator, dtype=torch.int64):
    """A [vocab, K] table of distinct experts per row, as a checkpoint's tid2eid."""
    rows = [torch.randperm(e, generator=g)[:k] for _ in range(vocab)]
    return torch.stack(rows).to(dtype).to(DEVICE)


def hash_routing(t, e, k, vocab, g, scoring="sqrtsoftplus", table_dtype=torch.int64):
    """Routing keywords for the kernels and the twin: a table, the token ids, V4's
    scoring and scaling."""
    tid2eid = hash_table(vocab, e, k, g, table_dtype)
    token_ids = torch.randint(0, vocab, (t,), generator=g).to(DEVICE)
    return dict(top_k=k, tid2eid=tid2eid, token_ids=token_ids, norm_topk_prob=True,
                routed_scaling_factor=1.5, scoring=scoring)  # fmt: skip


def hash_reference(logits, routing):
    return moe_hash_route_reference(
        logits, routing["token_ids"], routing["tid2eid"],
        norm_topk_prob=routing["norm_topk_prob"],
        routed_scaling_factor=routing["routed_scaling_factor"], scoring=routing["scoring"],
    )  # fmt: skip


# (T, E, K, vocab, scoring, table dtype): V4's sqrtsoftplus; E not a power of 2; sigmoid
# and an int32 table (the reference checkpoint's dtype)
ROUTE_CASES = [
    (5, 16, 3, 40, "sqrtsoftplus", torch.int64),
    (7, 12, 4, 9, "sqrtsoftplus", torch.int64),
    (3, 8, 2, 50, "sigmoid", torch.int32),
]


@pytest.mark.parametrize("case", ROUTE_CASES)
def test_hash_router_matches_reference(case):
    t, e, k, vocab, scoring, table_dtype = case
    g = torch.Generator().manual_seed(t + e)
    logits = torch.randn(t, e, generator=g).to(DEVICE)
    routing = hash_routing(t, e, k, vocab, g, scoring, table_dtype)
    weights, ids = moe_route(logits, **routing)
    want_w, want_ids = hash_reference(logits, routing)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)  # the table's rows, in the table's order
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)
    # The table, not the scores, chose: top-k would have picked other experts.
    topk_ids = moe_route_reference(logits, k, scoring=scoring)[1]
    assert not torch.equal(topk_ids.sort(-1).values, want_ids.sort(-1).values)


def test_hash_router_takes_a_table_row_that_repeats_an_expert():
    # transformers initialises tid2eid to zeros: every slot of every token is expert 0
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 8, generator=g).to(DEVICE)
    routing = hash_routing(4, 8, 3, 10, g)
    routing["tid2eid"] = torch.zeros_like(routing["tid2eid"])
    weights, ids = moe_route(logits, **routing)
    assert not ids.any()
    torch.testing.assert_close(weights, hash_reference(logits, routing)[0])
    torch.testing.assert_close(weights, torch.full_like(weights, 1.5 / 3))


# (T, D, E, K, block_d). On the interpreter (4 "SMs") T=1 splits the experts over programs
# and the last one routes; T=20 keeps each token's row in one program.
GATE_CASES = [(1, 96, 16, 3, 32), (2, 64, 8, 2, None), (20, 80, 12, 4, 32)]


@pytest.mark.parametrize("t,d,e,k,block_d", GATE_CASES)
def test_hash_gate_router_matches_reference(t, d, e, k, block_d):
    g = torch.Generator().manual_seed(t * d + e)
    x = torch.randn(t, d, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(e, d, generator=g) / d**0.5).to(DEVICE)
    routing = hash_routing(t, e, k, 30, g)
    weights, ids = moe_gate_route(x, w, block_d=block_d, **routing)
    want_w, want_ids = hash_reference(x.float() @ w.t(), routing)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-5, atol=1e-6)


def test_hash_routing_arguments_are_checked():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 8, generator=g).to(DEVICE)
    routing = hash_routing(3, 8, 2, 10, g)
    with pytest.raises(AssertionError, match="3 tokens"):
        moe_route(logits, **{**routing, "token_ids": routing["token_ids"][:2]})
    with pytest.raises(AssertionError, match="tid2eid must be"):
        moe_route(logits, **{**routing, "top_k": 3})
    with pytest.raises(AssertionError, match="no bias"):
        moe_route(logits, **routing, bias=torch.zeros(8, device=DEVICE))
    with pytest.raises(AssertionError, match="needs the step's token_ids"):
        moe_route(logits, **{**routing, "token_ids": None})


# (T, D, E, K, block_m, int8): one token (a tile per pair); several tokens grouped into
# 4-row tiles; 16 tokens with the int8 quantization.
PROLOGUE_CASES = [(1, 64, 16, 3, 16, False), (5, 96, 12, 3, 4, False), (16, 64, 8, 2, 1, True)]


@pytest.mark.parametrize("t,d,e,k,block_m,int8", PROLOGUE_CASES)
def test_hash_prologue_matches_its_torch_twin(t, d, e, k, block_m, int8, monkeypatch):
    g = torch.Generator().manual_seed(t + d + e)
    x = torch.randn(t, d, generator=g).bfloat16().to(DEVICE)
    w = (torch.randn(e, d, generator=g) / d**0.5).to(DEVICE)
    routing = hash_routing(t, e, k, 30, g)
    monkeypatch.setattr(prologue_module.torch, "empty", _poisoned_empty(torch.empty))
    got = moe_prologue(x, w, block_m=block_m, quantize_int8=int8, **routing)
    monkeypatch.undo()
    want = moe_prologue_reference(x, w, block_m=block_m, quantize_int8=int8, **routing)
    assert torch.equal(want.topk_ids, routing["tid2eid"][routing["token_ids"]])
    assert torch.equal(got.topk_ids.long(), want.topk_ids)
    torch.testing.assert_close(got.topk_weights, want.topk_weights, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.alignment.sorted_pairs, want.sorted_pairs)
    assert torch.equal(got.alignment.block_expert, want.block_expert)
    assert torch.equal(got.acc, want.acc)
    # the same float32 GEMV and routing code as the router's own launch: the same bits
    weights, ids = moe_gate_route(x, w, **routing)
    assert torch.equal(got.topk_ids, ids) and torch.equal(got.topk_weights, weights)


# A limit the values cross often: gate and up have std ~1 (bf16 weights) down to ~0.3
# (make_moe's FP8 and MXFP4 weights), so a third to a half of them are clamped.
LIMIT = 0.2


def _clamp_binds(args, kw, **extra):
    """The clamped and unclamped expert loops differ well beyond the kernels' tolerance,
    so a result within 2e-2 of the clamped one has the clamp."""
    clamped = fused_moe_reference(*args, **kw, **extra, swiglu_limit=LIMIT)
    assert rel_err(fused_moe_reference(*args, **kw, **extra), clamped) > 0.2
    return clamped


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("swap", [False, True])
def test_fused_moe_clamps_the_activation(fmt, swap):
    args, kw = make_moe(6, d=128, i=96, e=5, a=3, fmt=fmt, seed=31)
    # SWAP_AB with a D split: the last split to arrive applies the activation
    cfg = dict(BLOCK_M=16, BLOCK_N=64 if swap else 32, BLOCK_K=64 if fmt != "fp8" else 128,
               SWAP_AB=swap, GU_SPLIT_K=2 if swap else 1, num_warps=4, num_stages=2)  # fmt: skip
    want = _clamp_binds(args, kw)
    got = fused_moe(*args, **kw, config=cfg, swiglu_limit=LIMIT)
    assert rel_err(got, want) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_a_limit_no_value_reaches_gives_the_unclamped_bits(fmt):
    args, kw = make_moe(4, d=64, i=64, e=4, a=2, fmt=fmt, seed=32)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    plain = fused_moe(*args, **kw, config=cfg, out_dtype=torch.float32)
    huge = fused_moe(*args, **kw, config=cfg, out_dtype=torch.float32, swiglu_limit=1e30)
    assert torch.equal(plain, huge)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("t", [1, 20])
def test_fused_moe_clamps_the_shared_expert_by_its_own_limit(fmt, t):
    args, kw = make_moe(t, d=128, i=128, e=4, a=2, fmt="bf16", seed=t + 33)
    plain = random_shared(128, 256, fmt, seed=t + 34)
    shared = SharedExpert(plain.fmt, plain.w13, plain.w2, plain.w13_scale, plain.w2_scale,
                          swiglu_limit=LIMIT)  # fmt: skip
    one = torch.ones(t, 1, device=DEVICE)
    zero_ids = torch.zeros(t, 1, dtype=torch.int32, device=DEVICE)
    s13 = None if shared.w13_scale is None else shared.w13_scale[None]
    s2 = None if shared.w2_scale is None else shared.w2_scale[None]
    shared_args = (args[0], shared.w13[None], shared.w2[None], one, zero_ids)
    shared_kw = dict(fmt=fmt, w13_scale=s13, w2_scale=s2)
    ref_shared = _clamp_binds(shared_args, shared_kw).float()
    # routed experts unclamped, the shared expert clamped: each launch takes its own limit
    ref = fused_moe_reference(*args, **kw).float() + ref_shared
    got = fused_moe(*args, **kw, shared=shared, out_dtype=torch.float32)
    assert rel_err(got, ref) < 2e-2


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_ordered_combine_clamps(fmt):
    args, kw = make_moe(9, d=128, i=64, e=8, a=3, fmt=fmt, seed=35)
    want = _clamp_binds(args, kw)
    got = fused_moe(*args, **kw, config=fixed_config(fmt), ordered_combine=True,
                    out_dtype=torch.float32, swiglu_limit=LIMIT)  # fmt: skip
    assert rel_err(got, want) < 2e-2


def test_dequant_config_clamps():
    args, kw = make_moe(9, d=128, i=96, e=4, a=2, fmt="mxfp4", seed=36)
    cfg = dict(KERNEL="dequant", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    want = _clamp_binds(args, kw)
    assert rel_err(fused_moe(*args, **kw, config=cfg, swiglu_limit=LIMIT), want) < 2e-2


@pytest.mark.parametrize("prefetch", [True, False])
def test_int8_kernels_clamp(prefetch):
    args, kw = make_moe(3, d=128, i=64, e=4, a=2, fmt="mxfp4", seed=37)
    cfg = dict(KERNEL="int8", BLOCK_M=1, BLOCK_N=32, BLOCK_K=64, PREFETCH=prefetch)
    want = _clamp_binds(args, kw)
    assert rel_err(fused_moe(*args, **kw, config=cfg, swiglu_limit=LIMIT), want) < 3e-2


def test_hash_prologue_feeds_the_clamped_fused_moe():
    # One decode step as the engine runs a V4 hash layer: the prologue's routing and
    # grouping into fused_moe with the clamp, against the twins end to end.
    t, d, i, e, k = 3, 128, 64, 6, 2
    args, kw = make_moe(t, d=d, i=i, e=e, a=k, fmt="mxfp4", seed=38)
    x = args[0]
    g = torch.Generator().manual_seed(39)
    gate = (torch.randn(e, d, generator=g) / d**0.5).to(DEVICE)
    routing = hash_routing(t, e, k, 20, g)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2)
    pro = moe_prologue(x, gate, block_m=16, quantize_int8=False, **routing)
    got = fused_moe(x, args[1], args[2], pro.topk_weights, pro.topk_ids, **kw, config=cfg,
                    prologue=pro, out_dtype=torch.float32, swiglu_limit=LIMIT)  # fmt: skip
    weights, ids = hash_reference(x.float() @ gate.t(), routing)
    want = _clamp_binds((x, args[1], args[2], weights, ids), kw)
    assert rel_err(got, want) < 2e-2


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("t", [1, 8, 16])
def test_hash_prologue_and_clamp_gpu_v4_flash_shape_in_a_graph(t):
    # V4-Flash: E = 256, K = 6, D = 4096, I = 2048, MXFP4 experts, tid2eid [129280, 6]
    # int64. The hash prologue and the clamped fused MoE captured in one CUDA graph (no
    # host sync), replayed on new tokens, equal to the twins.
    e, k, d, i, vocab = 256, 6, 4096, 2048, 129280
    args, kw = make_moe(t, d=d, i=i, e=e, a=k, fmt="mxfp4", seed=t)
    x, w13, w2 = args[:3]
    g = torch.Generator().manual_seed(t)
    gate = (torch.randn(e, d, generator=g) / d**0.5).to(DEVICE)
    tid2eid = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(64)])
    tid2eid = tid2eid.repeat(vocab // 64, 1).to(DEVICE)  # [vocab, K] int64
    token_ids = torch.randint(0, vocab, (t,), generator=g).to(DEVICE)
    routing = dict(top_k=k, tid2eid=tid2eid, token_ids=token_ids, routed_scaling_factor=1.5,
                   scoring="sqrtsoftplus")  # fmt: skip
    cfg = choose_config(t, k, e, d, i, "mxfp4", x.device)

    def step():
        int8 = cfg.get("KERNEL") == "int8"
        pro = moe_prologue(x, gate, block_m=cfg["BLOCK_M"], quantize_int8=int8, **routing)
        return fused_moe(x, w13, w2, pro.topk_weights, pro.topk_ids, **kw, config=cfg,
                         prologue=pro, out_dtype=torch.float32, swiglu_limit=10.0)  # fmt: skip

    def reference():
        weights, ids = hash_reference(x.float() @ gate.t(), {**routing, "norm_topk_prob": True})
        return fused_moe_reference(x, w13, w2, weights, ids, **kw, swiglu_limit=10.0)

    step()  # eager first: the arrival counters are allocated outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(torch.randn_like(x) * 4)  # large enough that the limit binds
    token_ids.copy_(torch.randint(0, vocab, (t,), generator=g).to(DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(captured, reference()) < 2e-2
