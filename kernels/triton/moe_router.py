"""The MoE router as one kernel, with or without the gate matmul inside.

  logits = x.float() @ W.float().T  (moe_gate_route only; DeepSeek gates in float32)
  s = score(logits)               sigmoid (V3), sqrtsoftplus (V4: sqrt(softplus)) or softmax
  choice = s + bias               e_score_correction_bias steers selection only
  n_group > 1: group score = sum of its top-2 `choice`; keep the topk_group best groups
  ids = top_k of `choice` over the kept experts (others -inf, as DeepSeek's reference does)
  weights = s[ids]; if norm_topk_prob: / (sum + 1e-20); then * routed_scaling_factor

Both return topk_ids [T, top_k] int32 and topk_weights [T, top_k] float32, ordered by choice.

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
import triton.language as tl

from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, next_pow2

SCORING = {"sigmoid": 0, "sqrtsoftplus": 1, "softmax": 2}
GEMV_TILE = 4096  # weight elements one gate program holds per D step (experts x BLOCK_D)


@triton.jit
def _route_row(
    x,  # [BLOCK_E] float32 logits, -inf where masked
    offs,  # [BLOCK_E] expert index
    mask,  # [BLOCK_E] offs < E
    bias_ptr,
    ids_ptr,  # this token's [TOP_K] int32
    weights_ptr,  # this token's [TOP_K] float32
    E,
    scaling,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Score one token's logits and store its top-k ids and weights."""
    if SCORING == 0:
        s = 1.0 / (1.0 + tl.exp(-x))
    elif SCORING == 1:
        softplus = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
        s = tl.sqrt(softplus)
    else:
        ex = tl.exp(x - tl.max(x, axis=0))
        s = ex / tl.sum(ex, axis=0)
    s = tl.where(mask, s, 0.0)
    choice = s
    if HAS_BIAS:
        choice += tl.load(bias_ptr + offs, mask=mask, other=0.0)
    neg_inf = float("-inf")
    choice = tl.where(mask, choice, neg_inf)

    if N_GROUP > 1:
        group_size = E // N_GROUP
        group = offs // group_size
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_G,), neg_inf, tl.float32)
        for grp in tl.static_range(N_GROUP):
            in_grp = tl.where(group == grp, choice, neg_inf)
            first = tl.argmax(in_grp, axis=0)
            top1 = tl.max(in_grp, axis=0)
            top2 = tl.max(tl.where(offs == first, neg_inf, in_grp), axis=0)
            group_scores = tl.where(offs_g == grp, top1 + top2, group_scores)
        keep = tl.zeros((BLOCK_E,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(group_scores, axis=0)
            keep = keep | (group == best)
            group_scores = tl.where(offs_g == best, neg_inf, group_scores)
        choice = tl.where(keep, choice, neg_inf)

    offs_k = tl.arange(0, BLOCK_K)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        w = tl.sum(tl.where(offs == best, s, 0.0), axis=0)
        ids = tl.where(offs_k == j, best.to(tl.int32), ids)
        weights = tl.where(offs_k == j, w, weights)
        choice = tl.where(offs == best, neg_inf, choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling
    kmask = offs_k < TOP_K
    tl.store(ids_ptr + offs_k, ids, mask=kmask)
    tl.store(weights_ptr + offs_k, weights, mask=kmask)


@triton.jit
def moe_router_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] float32 (HAS_BIAS)
    ids_ptr,  # [T, TOP_K] int32
    weights_ptr,  # [T, TOP_K] float32
    E,
    stride_l,
    scaling,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    _route_row(
        x, offs, mask, bias_ptr, ids_ptr + row * TOP_K, weights_ptr + row * TOP_K, E, scaling,
        SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K,
    )  # fmt: skip


@triton.jit
def moe_gate_router_kernel(
    # pointers
    x_ptr,  # [T, D] any float dtype
    w_ptr,  # [E, D] float32 or bf16 gate weight
    bias_ptr,  # [E] float32 (HAS_BIAS)
    logits_ptr,  # [T, E] float32 scratch (SPLIT)
    counters_ptr,  # [T] int32, zero between launches (SPLIT; _arrival_counters)
    ids_ptr,  # [T, TOP_K] int32
    weights_ptr,  # [T, TOP_K] float32
    # sizes
    D,
    E,
    scaling,
    # strides
    stride_x,
    stride_w,
    stride_l,
    # meta-parameters
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GEMV_E: tl.constexpr,  # experts per program; SPLIT when GEMV_E < E
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    eb = tl.program_id(1)
    offs_e = eb * GEMV_E + tl.arange(0, GEMV_E)
    mask_e = offs_e < E
    # Products summed per lane over the D steps, then across lanes once: float32 throughout,
    # as x.float() @ W.float().T (the order of the sum differs from cuBLAS's by design).
    acc = tl.zeros((GEMV_E, BLOCK_D), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_ptr + t * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_e[:, None] * stride_w + offs_d[None, :],
                    mask=mask_e[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        acc += w.to(tl.float32) * x[None, :]
    logits = tl.sum(acc, axis=1)  # [GEMV_E]
    ids_row = ids_ptr + t * TOP_K
    weights_row = weights_ptr + t * TOP_K
    if SPLIT:
        tl.store(logits_ptr + t * stride_l + offs_e, logits, mask=mask_e)
        tl.debug_barrier()  # every thread's logits stored before the counter's release
        counter = counters_ptr + t
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(1) - 1:
            # The token's last expert block: its row is complete. .cg reads at L2, past this
            # SM's L1, which may hold stale lines of a scratch row an earlier launch used.
            offs = tl.arange(0, BLOCK_E)
            mask = offs < E
            row = tl.load(logits_ptr + t * stride_l + offs, mask=mask, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            _route_row(
                row, offs, mask, bias_ptr, ids_row, weights_row, E, scaling,
                SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K,
            )  # fmt: skip
            tl.atomic_xchg(counter, 0)  # zero again for the next launch
    else:  # one program holds the token's whole row (GEMV_E == BLOCK_E)
        row = tl.where(mask_e, logits, float("-inf"))
        _route_row(
            row, offs_e, mask_e, bias_ptr, ids_row, weights_row, E, scaling,
            SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K,
        )  # fmt: skip


def _check_routing(
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


def _routing_constants(
    e: int, top_k: int, has_bias: bool, n_group: int, topk_group: int, norm: bool, scoring: str
) -> dict:
    return dict(
        SCORING=SCORING[scoring], HAS_BIAS=has_bias,
        N_GROUP=n_group if topk_group < n_group else 1, TOPK_GROUP=topk_group,
        TOP_K=top_k, NORM=norm,
        BLOCK_E=next_pow2(e), BLOCK_G=next_pow2(n_group), BLOCK_K=next_pow2(top_k),
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (the gate matmul's output) -> (topk_ids [T, top_k] int32,
    topk_weights [T, top_k] float32). Field names follow DeepSeek's config.json."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, "logits must be a row-major [T, E]"
    t, e = logits.shape
    bias = _check_routing(e, top_k, bias, n_group, topk_group, scoring)
    check_device(logits)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    if t:
        moe_router_kernel[(t,)](
            logits, bias if bias is not None else logits, ids, weights,
            e, logits.stride(0), float(routed_scaling_factor),
            **_routing_constants(e, top_k, bias is not None, n_group, topk_group,
                                 norm_topk_prob, scoring),
            num_warps=4 if e > 128 else 1,
        )  # fmt: skip
    return ids, weights


def gate_experts_per_program(tokens: int, experts: int, device: torch.device) -> int:
    """The fewest experts per gate program (a power of 2) that keeps the grid within about
    two waves of the GPU: at T=1 one expert each, so the weight streams through E SMs."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
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
    block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (any float dtype) and the gate weight [E, D] (float32 or bf16) ->
    (topk_ids [T, top_k] int32, topk_weights [T, top_k] float32), the logits computed in
    float32 inside the launch. Same routing arguments as moe_route; `block_d` (a power of
    2) overrides the D step, for tests."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be a row-major [T, D]"
    assert gate_weight.dim() == 2 and gate_weight.stride(-1) == 1, "gate weight must be [E, D]"
    t, d = x.shape
    e = gate_weight.shape[0]
    assert gate_weight.shape[1] == d, f"gate weight {list(gate_weight.shape)} vs x [{t}, {d}]"
    bias = _check_routing(e, top_k, bias, n_group, topk_group, scoring)
    check_device(x, gate_weight)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    if t == 0:
        return ids, weights
    per = gate_experts_per_program(t, e, x.device)
    blocks = triton.cdiv(e, per)
    split = blocks > 1
    if split:
        logits = torch.empty((t, e), dtype=torch.float32, device=x.device)
        counters = arrival_counters(x.device, t)
    else:  # never read: one program per token keeps its row in registers
        logits = counters = weights
    moe_gate_router_kernel[(t, blocks)](
        x, gate_weight, bias if bias is not None else weights, logits, counters, ids, weights,
        d, e, float(routed_scaling_factor),
        x.stride(0), gate_weight.stride(0), logits.stride(0),
        **_routing_constants(e, top_k, bias is not None, n_group, topk_group,
                             norm_topk_prob, scoring),
        GEMV_E=per, BLOCK_D=block_d or min(next_pow2(d), max(GEMV_TILE // per, 32)),
        SPLIT=split,
        num_warps=4,
    )  # fmt: skip
    return ids, weights
