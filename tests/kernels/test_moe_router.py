import pytest
import torch

from kernels.reference.moe_router import moe_route_reference
from kernels.triton.moe_router import moe_route
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
    ids, w = moe_route(logits, **kw)
    ids_ref, w_ref = moe_route_reference(logits, **kw)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_router_matches_reference(case):
    _check(*case, seed=sum(case[:4]))


def test_router_group_limit_changes_the_choice():
    # Group 1 holds the single best expert but group 0 has the better top-2 sum.
    logits = torch.tensor([[2.0, 1.9, -3.0, -3.0, 3.0, -3.0, -3.0, -3.0]], device=DEVICE)
    ids, _ = moe_route(logits, top_k=2, n_group=2, topk_group=1)
    assert sorted(ids[0].tolist()) == [0, 1]


@pytest.mark.gpu
@gpu_only
def test_router_gpu_deepseek_v3_shape():
    _check(512, 256, 8, 8, 4, "sigmoid", True, True, 2.5, seed=0)
