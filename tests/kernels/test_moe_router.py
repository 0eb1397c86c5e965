import pytest
import torch

from kernels.reference.moe_router import moe_gate_route_reference, moe_route_reference
from kernels.triton._arrival_counters import arrival_counters
from kernels.triton.moe_router import gate_experts_per_program, moe_gate_route, moe_route
from tests.kernels._helpers import DEVICE, gpu_only

CASES = [
    # (T, E, top_k, n_group, topk_group, scoring, bias, norm, scale)
    (5, 8, 2, 2, 1, "sigmoid", True, True, 2.5),  # V3-style groups, tiny
    (4, 12, 3, 3, 2, "sigmoid", True, True, 1.0),  # non power-of-two groups
    (3, 16, 4, 1, 1, "sqrtsoftplus", True, True, 1.5),  # V4-style, no groups
    (3, 10, 3, 1, 1, "softmax", False, False, 1.0),
]


def _check(t, e, k, ng, tg, scoring, with_bias, norm, scale, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g).to(DEVICE)
    bias = (0.3 * torch.randn(e, generator=g)).to(DEVICE) if with_bias else None
    kw = dict(top_k=k, bias=bias, n_group=ng, topk_group=tg, norm_topk_prob=norm,
              routed_scaling_factor=scale, scoring=scoring)  # fmt: skip
    w, ids = moe_route(logits, **kw)
    w_ref, ids_ref = moe_route_reference(logits, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_router_matches_reference(case):
    _check(*case, seed=sum(case[:4]))


def test_router_group_limit_changes_the_choice():
    # Group 1 holds the single best expert but group 0 has the better top-2 sum.
    logits = torch.tensor([[2.0, 1.9, -3.0, -3.0, 3.0, -3.0, -3.0, -3.0]], device=DEVICE)
    _, ids = moe_route(logits, top_k=2, n_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [0, 1]


def test_reference_group_score_max_keeps_the_group_of_the_best_expert():
    # V2's group_limited_greedy: a group scores its best expert, and dropped experts are
    # filled with 0.0 (scores are > 0, so they are never chosen while enough kept ones
    # remain). Group 0 has the better top-2 sum, group 1 the best expert.
    logits = torch.tensor([[2.0, 1.9, -3.0, -3.0, 3.0, -3.0, -3.0, -3.0]])
    kw = dict(top_k=2, n_group=2, topk_group=1, scoring="sigmoid")
    _, top2 = moe_route_reference(logits, **kw)
    weights, ids = moe_route_reference(logits, group_score="max", **kw)
    assert sorted(top2[0].tolist()) == [0, 1]
    assert ids[0, 0] == 4 and ids[0, 1] in (5, 6, 7)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    probs = logits.sigmoid()
    want = probs[0, ids[0]] / probs[0, ids[0]].sum()
    torch.testing.assert_close(weights[0], want)


def test_reference_unsorted_picks_the_same_experts():
    g = torch.Generator().manual_seed(8)
    logits, bias = torch.randn(6, 16, generator=g), torch.randn(16, generator=g)
    kw = dict(top_k=4, bias=bias, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    w_sorted, ids_sorted = moe_route_reference(logits, **kw)
    w, ids = moe_route_reference(logits, sorted=False, **kw)
    order = ids.sort(-1).indices
    assert torch.equal(ids.gather(1, order), ids_sorted.sort(-1).values)
    torch.testing.assert_close(w.gather(1, order), w_sorted.gather(1, ids_sorted.sort(-1).indices))


@pytest.mark.gpu
@gpu_only
def test_router_gpu_deepseek_v3_shape():
    _check(512, 256, 8, 8, 4, "sigmoid", True, True, 2.5, seed=0)


# (T, D, E, top_k, n_group, topk_group, scoring, bias, norm, scale, x dtype, weight dtype,
#  block_d). On the interpreter (4 "SMs") T=1 splits the experts over programs and the last
# one routes; T=20 keeps each token's row in one program. block_d < D runs the D loop.
GATE_CASES = [
    (1, 96, 8, 2, 2, 1, "sigmoid", True, True, 2.5, torch.bfloat16, torch.float32, 32),
    (1, 64, 16, 4, 1, 1, "sqrtsoftplus", True, True, 1.5, torch.bfloat16, torch.float32, None),
    (3, 80, 12, 3, 3, 2, "sigmoid", True, True, 1.0, torch.float32, torch.float32, 32),
    (20, 48, 10, 3, 1, 1, "softmax", False, False, 1.0, torch.float16, torch.bfloat16, None),
    (20, 130, 16, 4, 4, 2, "sigmoid", True, True, 2.5, torch.bfloat16, torch.bfloat16, 64),
]


def _gate_check(t, d, e, k, ng, tg, scoring, with_bias, norm, scale, xdt, wdt, block_d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(xdt).to(DEVICE)
    w = (torch.randn(e, d, generator=g) / d**0.5).to(wdt).to(DEVICE)
    bias = (0.3 * torch.randn(e, generator=g)).to(DEVICE) if with_bias else None
    kw = dict(top_k=k, bias=bias, n_group=ng, topk_group=tg, norm_topk_prob=norm,
              routed_scaling_factor=scale, scoring=scoring)  # fmt: skip
    weights, ids = moe_gate_route(x, w, block_d=block_d, **kw)
    weights_ref, ids_ref = moe_gate_route_reference(x, w, **kw)
    # Exact float32 logits in another summation order differ by a few ulps: the ids must
    # match where the choice is well separated. Precondition: float64 logits pick the same
    # ids, so a near tie shows up as a bad seed, not as a kernel bug.
    logits64 = (x.double() @ w.double().t()).float()
    assert torch.equal(moe_route_reference(logits64, **kw)[1], ids_ref), "near tie: pick a seed"
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(weights, weights_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", GATE_CASES)
def test_gate_router_matches_reference(case):
    _gate_check(*case, seed=case[0] + case[1] + case[2])


def test_gate_router_leaves_counters_zero_for_the_next_launch():
    # Twice on new inputs: a counter left non-zero would make no program the last one and
    # leave the ids unwritten.
    for seed in (3, 4):
        _gate_check(1, 64, 16, 4, 1, 1, "sigmoid", True, True, 1.0,
                    torch.bfloat16, torch.float32, None, seed=seed)  # fmt: skip
        assert not arrival_counters(torch.device(DEVICE), 1).any()


def test_gate_experts_per_program_fills_the_gpu_without_a_wave_per_token():
    cpu = torch.device("cpu")  # 4 "SMs": at most 8 programs unless one holds all experts
    assert gate_experts_per_program(1, 8, cpu) == 1
    assert gate_experts_per_program(3, 12, cpu) == 8
    assert gate_experts_per_program(20, 10, cpu) == 16


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("t", [1, 8, 64, 300])
def test_gate_router_gpu_moonlight_shape(t):
    _gate_check(t, 2048, 64, 6, 1, 1, "sigmoid", True, True, 2.446, torch.bfloat16,
                torch.float32, None, seed=t)  # fmt: skip


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("t", [1, 32])
def test_gate_router_gpu_deepseek_v3_shape(t):
    _gate_check(t, 7168, 256, 8, 8, 4, "sigmoid", True, True, 2.5, torch.bfloat16,
                torch.float32, None, seed=t)  # fmt: skip
