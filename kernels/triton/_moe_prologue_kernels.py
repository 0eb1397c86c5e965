"""@triton.jit body of kernels/triton/moe_prologue.py (the wrapper says which programs do
what). Its pieces are the router's, the grouping's and the int8 quantization's own device
functions, so the one launch gives their bits."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.triton._moe_align_kernels import align_pairs, zero_block
from kernels.triton._moe_int8_kernels import quantize_row_block
from kernels.triton._moe_router_kernels import gate_logits, hash_row_of, route_split_row


@triton.jit
def moe_prologue_kernel(
    # pointers
    x_ptr,  # [T, D] any float dtype
    w_ptr,  # [E, D] float32 or bf16 gate weight
    bias_ptr,  # [E] float32 (HAS_BIAS)
    tid2eid_ptr,  # [vocab, TOP_K] int (HASH)
    token_ids_ptr,  # [T] int (HASH)
    logits_ptr,  # [T, E] float32 scratch
    counters_ptr,  # [T + 1] int32, zero between launches: per token, then all tokens
    ids_ptr,  # [T, TOP_K] int32 out
    weights_ptr,  # [T, TOP_K] float32 out
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 out
    block_expert_ptr,  # [max_blocks] int32 out (unless TILE_PER_PAIR: the ids are)
    xq_ptr,  # [T, D/4] int32 out (QUANT)
    xs_ptr,  # [T, D/32] float32 out (QUANT)
    acc_ptr,  # [T * D] float32, zeroed
    # sizes
    T,
    D,
    E,
    scaling,
    max_blocks,
    # strides
    stride_x,
    stride_w,
    stride_xq,
    stride_xs,
    # meta-parameters: routing (moe_router.routing_constants)
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
    GEMV_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    # grouping (moe_align)
    BLOCK_M: tl.constexpr,
    TILE_PER_PAIR: tl.constexpr,  # BLOCK_M == 1, or one token (its experts are distinct)
    CHUNK: tl.constexpr,
    TILES: tl.constexpr,
    # quantization and zeroing
    QUANT: tl.constexpr,
    QBLOCK: tl.constexpr,
    ZBLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    blocks = tl.cdiv(E, GEMV_E)
    if pid < T * blocks:
        t = (pid // blocks).to(tl.int64)
        offs_e = (pid % blocks) * GEMV_E + tl.arange(0, GEMV_E)
        mask_e = offs_e < E
        logits = gate_logits(x_ptr + t * stride_x, w_ptr, offs_e, mask_e, D, stride_w,
                             GEMV_E, BLOCK_D)  # fmt: skip
        routed = route_split_row(
            logits, offs_e, mask_e, logits_ptr + t * E, counters_ptr + t, blocks, bias_ptr,
            hash_row_of(tid2eid_ptr, token_ids_ptr, t, TOP_K, HASH),
            ids_ptr + t * TOP_K, weights_ptr + t * TOP_K, E, scaling,
            SCORING, HAS_BIAS, N_GROUP, TOPK_GROUP, TOP_K, NORM, BLOCK_E, BLOCK_G, BLOCK_K, HASH,
        )  # fmt: skip
        if not TILE_PER_PAIR:
            if routed:
                tl.debug_barrier()  # the token's ids stored by every thread before the release
                everyone = counters_ptr + T
                if tl.atomic_add(everyone, 1, sem="acq_rel", scope="gpu") == T - 1:
                    # Every token is routed: group the pairs (ids read at L2, as the logits).
                    align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, T * TOP_K, E,
                                max_blocks, BLOCK_M, BLOCK_E, CHUNK, TILES, ".cg")  # fmt: skip
                    tl.atomic_xchg(everyone, 0)
        elif pid % blocks == 0:
            # A tile per pair: the pairs in their own order are a grouping (tile p holds
            # pair p, of expert ids[p], then BLOCK_M - 1 pads: block_expert is the ids
            # themselves), so nothing waits for the routing.
            offs_k = tl.arange(0, BLOCK_K)
            pairs = t * TOP_K + offs_k
            slots = pairs[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
            entry = tl.where(slots % BLOCK_M == 0, pairs[:, None], T * TOP_K)  # pad: P
            tl.store(sorted_ptr + slots, entry.to(tl.int32), mask=(offs_k < TOP_K)[:, None])
        return
    pid -= T * blocks
    if QUANT:
        q_blocks = tl.cdiv(D, QBLOCK)
        if pid < T * q_blocks:
            quantize_row_block(x_ptr, xq_ptr, xs_ptr, pid // q_blocks, pid % q_blocks, D,
                               stride_x, stride_xq, stride_xs, QBLOCK)  # fmt: skip
            return
        pid -= T * q_blocks
    zero_block(acc_ptr, pid, T * D, ZBLOCK)
