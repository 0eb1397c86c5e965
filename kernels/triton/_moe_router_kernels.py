"""Triton bodies for moe_router.py: the routing of one token's logits row (top-k, or the
token's tid2eid row under HASH), the router over given logits, and the router with the
float32 gate GEMV inside."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def route_row(
    x,  # [BLOCK_E] float32 logits, -inf where masked
    offs,  # [BLOCK_E] expert index
    mask,  # [BLOCK_E] offs < E
    bias_ptr,
    hash_row,  # this token's [TOP_K] tid2eid row (HASH; hash_row_of)
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
    HASH: tl.constexpr,
):
    """Score one token's logits and store its ids and weights: the top-k of the (biased,
    group-limited) scores, or under HASH the token's tid2eid row in the table's order."""
    if SCORING == 0:
        s = 1.0 / (1.0 + tl.exp(-x))
    elif SCORING == 1:
        softplus = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
        s = tl.sqrt(softplus)
    else:
        ex = tl.exp(x - tl.max(x, axis=0))
        s = ex / tl.sum(ex, axis=0)
    s = tl.where(mask, s, 0.0)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < TOP_K
    if HASH:
        ids = tl.load(hash_row + offs_k, mask=kmask, other=0).to(tl.int32)
        # One expert matches per slot, so the sum is that expert's score exactly.
        hit = offs[None, :] == ids[:, None]  # [BLOCK_K, BLOCK_E]
        weights = tl.sum(tl.where(hit & kmask[:, None], s[None, :], 0.0), axis=1)
    else:
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
    tl.store(ids_ptr + offs_k, ids, mask=kmask)
    tl.store(weights_ptr + offs_k, weights, mask=kmask)


@triton.jit
def hash_row_of(tid2eid_ptr, token_ids_ptr, t, TOP_K: tl.constexpr, HASH: tl.constexpr):
    """Token t's row of the contiguous [vocab, TOP_K] tid2eid table, read by its token id
    (HASH); else the table pointer itself, never read."""
    row = tid2eid_ptr
    if HASH:
        row = tid2eid_ptr + tl.load(token_ids_ptr + t).to(tl.int64) * TOP_K
    return row


@triton.jit
def moe_router_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] float32 (HAS_BIAS)
    tid2eid_ptr,  # [vocab, TOP_K] int (HASH)
    token_ids_ptr,  # [T] int (HASH)
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
    HASH: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
    route_row(
        x, offs, mask, bias_ptr, hash_row_of(tid2eid_ptr, token_ids_ptr, row, TOP_K, HASH),
        ids_ptr + row * TOP_K, weights_ptr + row * TOP_K, E, scaling,
        SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K, HASH,
    )  # fmt: skip


@triton.jit
def gate_logits(x_row, w_ptr, offs_e, mask_e, D, stride_w, GEMV_E: tl.constexpr,
                BLOCK_D: tl.constexpr):  # fmt: skip
    """float32 logits [GEMV_E] of experts offs_e for one token's row x_row [D]."""
    # Products summed per lane over the D steps, then across lanes once: float32 throughout,
    # as x.float() @ W.float().T (the order of the sum differs from cuBLAS's by design).
    acc = tl.zeros((GEMV_E, BLOCK_D), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_e[:, None] * stride_w + offs_d[None, :],
                    mask=mask_e[:, None] & mask_d[None, :], other=0.0)  # fmt: skip
        acc += w.to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def route_split_row(
    logits,  # [GEMV_E] float32: this program's block of the token's logits
    offs_e,
    mask_e,
    logits_row,  # the token's [E] float32 scratch row
    counter,  # the token's arrival counter (_arrival_counters)
    blocks,  # expert blocks per token
    bias_ptr,
    hash_row,  # the token's tid2eid row (HASH)
    ids_row,
    weights_row,
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
    HASH: tl.constexpr,
):
    """Store a block of the token's logits and count it in; the token's last block to
    arrive routes the completed row. Returns whether this program was that one."""
    tl.store(logits_row + offs_e, logits, mask=mask_e)
    tl.debug_barrier()  # every thread's logits stored before the counter's release
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == blocks - 1
    if last:
        # The row is complete. .cg reads at L2, past this SM's L1, which may hold stale
        # lines of a scratch row an earlier launch used.
        offs = tl.arange(0, BLOCK_E)
        mask = offs < E
        row = tl.load(logits_row + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
        route_row(
            row, offs, mask, bias_ptr, hash_row, ids_row, weights_row, E, scaling,
            SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K, HASH,
        )  # fmt: skip
        tl.atomic_xchg(counter, 0)  # zero again for the next launch
    return last


@triton.jit
def moe_gate_router_kernel(
    # pointers
    x_ptr,  # [T, D] any float dtype
    w_ptr,  # [E, D] float32 or bf16 gate weight
    bias_ptr,  # [E] float32 (HAS_BIAS)
    tid2eid_ptr,  # [vocab, TOP_K] int (HASH)
    token_ids_ptr,  # [T] int (HASH)
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
    HASH: tl.constexpr,
    GEMV_E: tl.constexpr,  # experts per program; SPLIT when GEMV_E < E
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    eb = tl.program_id(1)
    offs_e = eb * GEMV_E + tl.arange(0, GEMV_E)
    mask_e = offs_e < E
    logits = gate_logits(x_ptr + t * stride_x, w_ptr, offs_e, mask_e, D, stride_w, GEMV_E, BLOCK_D)
    ids_row = ids_ptr + t * TOP_K
    weights_row = weights_ptr + t * TOP_K
    hash_row = hash_row_of(tid2eid_ptr, token_ids_ptr, t, TOP_K, HASH)
    if SPLIT:
        route_split_row(
            logits, offs_e, mask_e, logits_ptr + t * stride_l, counters_ptr + t,
            tl.num_programs(1), bias_ptr, hash_row, ids_row, weights_row, E, scaling,
            SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K, HASH,
        )  # fmt: skip
    else:  # one program holds the token's whole row (GEMV_E == BLOCK_E)
        row = tl.where(mask_e, logits, float("-inf"))
        route_row(
            row, offs_e, mask_e, bias_ptr, hash_row, ids_row, weights_row, E, scaling,
            SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K, HASH,
        )  # fmt: skip
