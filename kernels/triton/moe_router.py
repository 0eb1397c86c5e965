"""The MoE router as one kernel, with or without the gate matmul inside. Its torch twin,
and the statement of the routing it computes, is kernels/reference/moe_router.py
(`moe_route_reference`; the "top2" group score). Legend: docs/shapes.md.

  logits = x.float() @ W.float().T  (moe_gate_route only; DeepSeek gates in float32)
  s = score(logits)               sigmoid (V3), sqrtsoftplus (V4: sqrt(softplus)) or softmax
  choice = s + bias               e_score_correction_bias steers selection only
  n_group > 1: group score = sum of its top-2 `choice`; keep the topk_group best groups
  ids = top_k of `choice` over the kept experts (others -inf, as DeepSeek's reference does)
  weights = s[ids]; if norm_topk_prob: / (sum + 1e-20); then * routed_scaling_factor

Hash routing (`tid2eid` and `token_ids` given; V4's first layers): ids = tid2eid[token_ids]
in the table's order, no bias and no groups; the weights as above
(`moe_hash_route_reference`). The table is read on the device, by each token's id, so a
hash-routed step needs no host sync either.

Both return (topk_weights [T, K] float32, topk_ids [T, K] int32), ordered by choice, best
first: the (weights, ids) order of every router in the house.

moe_route takes the logits (one program per token). moe_gate_route takes x [T, D] in its own
dtype and the gate weight [E, D] (float32 or bf16) and replaces x.float(), the float32
GEMV (cuBLAS: a dot and a split-K reduce) and the router: 4 launches -> 1. At decode sizes
one program per token would stream the whole weight (Moonlight: 64 x 2048 float32 = 512 KB)
through one SM, so the grid is (token, block of experts): each program computes its
experts' float32 logits and writes them to a scratch row, and the last program of a token
to finish (an arrival counter) scores the row and picks the top-k. Each program re-reads
its weight block per token (from L2 after the first), so large T belongs to cuBLAS plus
moe_route.
"""

from __future__ import annotations

import torch
import triton

from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, next_pow2, sm_count
from kernels.triton._moe_router_kernels import moe_gate_router_kernel, moe_router_kernel

SCORING = {"sigmoid": 0, "sqrtsoftplus": 1, "softmax": 2}
GEMV_TILE = 4096  # weight elements one gate program holds per D step (experts x BLOCK_D)


def check_routing(
    e: int, top_k: int, bias: torch.Tensor | None, n_group: int, topk_group: int, scoring: str
) -> torch.Tensor | None:
    """Validate the routing arguments; returns the bias as a float32 contiguous [E]."""
    assert scoring in SCORING, f"scoring must be one of {list(SCORING)}, got {scoring!r}"
    assert 1 <= top_k <= e, f"top_k must be in [1, {e}], got {top_k}"
    assert e % n_group == 0, f"n_routed_experts {e} is not divisible by n_group {n_group}"
    if n_group > 1:
        assert 1 <= topk_group <= n_group, f"topk_group must be in [1, {n_group}], got {topk_group}"
        assert top_k <= topk_group * (e // n_group), "top_k exceeds the experts in the kept groups"
    if bias is None:
        return None
    assert bias.shape == (e,), f"e_score_correction_bias must be [{e}], got {list(bias.shape)}"
    return bias.float().contiguous()


def check_hash(
    t: int,
    top_k: int,
    tid2eid: torch.Tensor | None,
    token_ids: torch.Tensor | None,
    bias: torch.Tensor | None,
    n_group: int,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Validate hash routing's arguments; returns (tid2eid, token_ids) contiguous, or None
    without a table. The table's entries must be expert ids < E: they are not checked
    here, which would read them back to the host."""
    if tid2eid is None:
        assert token_ids is None, "token_ids are read only with a tid2eid table"
        return None
    assert token_ids is not None, "hash routing needs the step's token_ids"
    assert tid2eid.dim() == 2 and tid2eid.shape[1] == top_k, (
        f"tid2eid must be [vocab, top_k={top_k}], got {list(tid2eid.shape)}"
    )
    assert not tid2eid.is_floating_point() and not token_ids.is_floating_point(), (
        "tid2eid and token_ids must be integer tensors"
    )
    assert token_ids.numel() == t, f"{token_ids.numel()} token_ids for {t} tokens"
    assert bias is None and n_group == 1, "hash routing takes no bias and no expert groups"
    return tid2eid.contiguous(), token_ids.reshape(-1).contiguous()


def routing_constants(
    e: int, top_k: int, has_bias: bool, n_group: int, topk_group: int, norm: bool, scoring: str,
    hashed: bool = False,
) -> dict:  # fmt: skip
    return dict(
        SCORING=SCORING[scoring], HAS_BIAS=has_bias,
        N_GROUP=n_group if topk_group < n_group else 1, TOPK_GROUP=topk_group,
        TOP_K=top_k, NORM=norm,
        BLOCK_E=next_pow2(e), BLOCK_G=next_pow2(n_group), BLOCK_K=next_pow2(top_k),
        HASH=hashed,
    )  # fmt: skip


def moe_route(
    logits: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the gate matmul's output) -> (topk_weights [T, K] float32,
    topk_ids [T, K] int32). Field names follow DeepSeek's config.json; `tid2eid` [vocab, K]
    and `token_ids` [T] (both int) route by hash instead of by top-k."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be a row-major [T, E]"
    t, e = logits.shape
    bias = check_routing(e, top_k, bias, n_group, topk_group, scoring)
    hashed = check_hash(t, top_k, tid2eid, token_ids, bias, n_group)
    check_device(logits, *(hashed or ()))
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        moe_router_kernel[(t,)](
            logits, bias if bias is not None else logits, *(hashed or (ids, ids)), ids, weights,
            e, logits.stride(0), float(routed_scaling_factor),
            **routing_constants(e, top_k, bias is not None, n_group, topk_group,
                                norm_topk_prob, scoring, hashed is not None),
            num_warps=4 if e > 128 else 1,
        )  # fmt: skip
    return weights, ids


def gate_experts_per_program(tokens: int, experts: int, device: torch.device) -> int:
    """The fewest experts per gate program (a power of 2) that keeps the grid within about
    two waves of the GPU: at T=1 one expert each, so the weight streams through E SMs."""
    sms = sm_count(device)
    per = 1
    while per < next_pow2(experts) and tokens * triton.cdiv(experts, per) > 2 * sms:
        per *= 2
    return per


def moe_gate_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
    block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (any float dtype) and the gate weight [E, D] (float32 or bf16) ->
    (topk_weights [T, K] float32, topk_ids [T, K] int32), the logits computed in
    float32 inside the launch. Same routing arguments as moe_route; `block_d` (a power of
    2) overrides the D step, for tests."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be a row-major [T, D]"
    assert gate_weight.dim() == 2 and gate_weight.stride(-1) == 1, "gate weight must be [E, D]"
    t, d = x.shape
    e = gate_weight.shape[0]
    assert gate_weight.shape[1] == d, f"gate weight {list(gate_weight.shape)} vs x [{t}, {d}]"
    bias = check_routing(e, top_k, bias, n_group, topk_group, scoring)
    hashed = check_hash(t, top_k, tid2eid, token_ids, bias, n_group)
    check_device(x, gate_weight, *(hashed or ()))
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    if t == 0:
        return weights, ids
    per = gate_experts_per_program(t, e, x.device)
    blocks = triton.cdiv(e, per)
    split = blocks > 1
    if split:
        logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, t)
    else:  # never read: one program per token keeps its row in registers
        logits = counters = weights
    moe_gate_router_kernel[(t, blocks)](
        x, gate_weight, bias if bias is not None else weights, *(hashed or (ids, ids)),
        logits, counters, ids, weights,
        d, e, float(routed_scaling_factor),
        x.stride(0), gate_weight.stride(0), logits.stride(0),
        **routing_constants(e, top_k, bias is not None, n_group, topk_group,
                            norm_topk_prob, scoring, hashed is not None),
        GEMV_E=per, BLOCK_D=block_d or min(next_pow2(d), max(GEMV_TILE // per, 32)),
        SPLIT=split,
        num_warps=4,
    )  # fmt: skip
    return weights, ids
