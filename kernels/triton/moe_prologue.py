"""The fused MoE's decode prologue in one launch: the router (float32 gate GEMV, scoring,
top-k), the grouping of the (token, expert) pairs by expert, the int8 quantization of x
(for the int8 MXFP4 kernels) and the zeroing of the float32 accumulator.

Why: at batch 1 each of these as a launch of its own is a short chain of dependent memory
round trips on a few SMs (H200: router 5.9 us, moe_align 2.5, act_quant_int8 1.2 per layer,
plus ~1.3 us between dependent launches in a graph). Their work is
independent except router -> grouping, which an arrival counter orders inside the launch:

  programs [0, T * blocks)      gate GEMV of (token, block of experts) -> logits scratch;
                                a token's last block routes its row (route_split_row:
                                top-k, or its tid2eid row by token id);
                                the last token routed groups all pairs (align_pairs),
                                unless each pair has a tile of its own (the int8
                                kernels' BLOCK_M = 1, or one token: its experts are
                                distinct): then pair order is a grouping, the ids the
                                tile map
  next T * cdiv(D, QBLOCK)      int8 x 4 words and scales of x (QUANT only)
  the rest                      zero the accumulator, ZBLOCK floats each

The results are what moe_gate_route, moe_align(zero=acc) and the int8 path's activation
quantization give (with a tile per pair the pairs keep their own order, an equally valid
grouping); fused_moe takes them through `prologue=` instead of launching its own. Decode
sizes only (PROLOGUE_MAX_TOKENS): one program groups every pair.

The @triton.jit body is _moe_prologue_kernels.py; the torch twin is
kernels/reference/moe_prologue.py. Legend: docs/shapes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.triton._arrival_counters import arrival_counters
from kernels.triton._common import check_device, next_pow2
from kernels.triton._moe_int8_kernels import INT8_QUANT_BLOCK
from kernels.triton._moe_prologue_kernels import moe_prologue_kernel
from kernels.triton.moe_align import ZERO_BLOCK, MoeAlignment, max_padded_pairs
from kernels.triton.moe_router import (
    GEMV_TILE,
    check_hash,
    check_routing,
    gate_experts_per_program,
    routing_constants,
)

PROLOGUE_MAX_TOKENS = 16


@dataclass
class MoePrologue:
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K] int32
    alignment: MoeAlignment
    acc: torch.Tensor  # [T, D] float32, zeroed
    x_int8: tuple[torch.Tensor, torch.Tensor] | None  # ([T, D/4] int32 words, [T, D/32] scales)


def moe_prologue(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    block_m: int,
    quantize_int8: bool,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
    scoring: str = "sigmoid",
    tid2eid: torch.Tensor | None = None,
    token_ids: torch.Tensor | None = None,
) -> MoePrologue:
    """x [T, D] (bf16/fp16, T <= PROLOGUE_MAX_TOKENS) and the gate weight [E, D] -> the
    routing, the pairs grouped into tiles of `block_m` rows (the fused MoE
    config's BLOCK_M), x quantized for the int8 kernels when `quantize_int8`, and a zeroed
    float32 accumulator [T, D]. Routing arguments as moe_router.moe_gate_route's (hash
    routing by `tid2eid` and `token_ids` included)."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be a row-major [T, D]"
    assert gate_weight.dim() == 2 and gate_weight.stride(-1) == 1, "gate weight must be [E, D]"
    t, d = x.shape
    e = gate_weight.shape[0]
    assert gate_weight.shape[1] == d, f"gate weight {list(gate_weight.shape)} vs x [{t}, {d}]"
    assert 1 <= t <= PROLOGUE_MAX_TOKENS, (
        f"the MoE prologue takes 1..{PROLOGUE_MAX_TOKENS} tokens, got {t}"
    )
    assert not quantize_int8 or d % 32 == 0, f"int8 activations need D % 32 == 0, got {d}"
    bias = check_routing(e, top_k, bias, n_group, topk_group, scoring)
    hashed = check_hash(t, top_k, tid2eid, token_ids, bias, n_group)
    check_device(x, gate_weight, *(hashed or ()))
    device = x.device
    p = t * top_k
    max_blocks = -(-max_padded_pairs(p, e, block_m) // block_m)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=device)
    weights = torch.empty((t, top_k), dtype=torch.float32, device=device)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    # A tile per pair where no two pairs share an expert's tile anyway: one-pair tiles, or
    # one token, whose top-k experts are distinct. Then max_blocks = P, tile p is pair p
    # (and pads), and its expert ids[p].
    tile_per_pair = block_m == 1 or t == 1
    assert not tile_per_pair or max_blocks == p
    block_expert = ids.view(-1) if tile_per_pair else torch.empty(max_blocks, dtype=torch.int32,
                                                                  device=device)  # fmt: skip
    acc = torch.empty((t, d), dtype=torch.float32, device=device)
    logits = torch.empty((t, e), dtype=torch.float32, device=device)
    counters = arrival_counters(device, t + 1)
    if quantize_int8:
        xq = torch.empty((t, d // 4), dtype=torch.int32, device=device)
        xs = torch.empty((t, d // 32), dtype=torch.float32, device=device)
        quant_programs = t * triton.cdiv(d, INT8_QUANT_BLOCK)
    else:  # never written
        xq, xs, quant_programs = sorted_pairs, acc, 0
    per = gate_experts_per_program(t, e, device)
    block_e = next_pow2(e)
    programs = t * triton.cdiv(e, per) + quant_programs + triton.cdiv(t * d, ZERO_BLOCK)
    moe_prologue_kernel[(programs,)](
        x, gate_weight, bias if bias is not None else weights, *(hashed or (ids, ids)),
        logits, counters, ids, weights,
        sorted_pairs, block_expert, xq, xs, acc,
        t, d, e, float(routed_scaling_factor), max_blocks,
        x.stride(0), gate_weight.stride(0), xq.stride(0), xs.stride(0),
        **routing_constants(e, top_k, bias is not None, n_group, topk_group, norm_topk_prob,
                            scoring, hashed is not None),
        GEMV_E=per, BLOCK_D=min(next_pow2(d), max(GEMV_TILE // per, 32)),
        BLOCK_M=block_m, TILE_PER_PAIR=tile_per_pair, CHUNK=max(16, min(256, 8192 // block_e, next_pow2(p))),
        TILES=max(16, min(64, next_pow2(max_blocks))),
        QUANT=quantize_int8, QBLOCK=INT8_QUANT_BLOCK, ZBLOCK=ZERO_BLOCK, num_warps=4,
    )  # fmt: skip
    return MoePrologue(
        weights,
        ids,
        MoeAlignment(sorted_pairs, block_expert, p, block_m),
        acc,
        (xq, xs) if quantize_int8 else None,
    )
