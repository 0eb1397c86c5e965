"""Torch twin of kernels/triton/moe_prologue.py, composed of the twins of its parts: the
routing (moe_router), the grouping of the pairs (moe_align) and the int8 quantization of
x (moe_int8), beside a zeroed float32 accumulator.

Legend: docs/shapes.md (T tokens, D hidden, E experts, K experts per token). Where every
pair has a tile of its own (BLOCK_M = 1, or one token, whose K experts are distinct) the
kernel keeps the pairs in their own order, an equally valid grouping the fused MoE reads
the same way: tile p holds pair p and BLOCK_M - 1 pads, and its expert is ids[p]. The
twin gives that layout there too, so the kernel's result can be compared slot for slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.reference.moe_align import moe_align_reference
from kernels.reference.moe_int8 import act_quant_int8_reference
from kernels.reference.moe_router import moe_gate_route_reference, moe_hash_route_reference


@dataclass
class MoePrologueReference:
    topk_weights: torch.Tensor  # [T, K] float32
    topk_ids: torch.Tensor  # [T, K] int64
    sorted_pairs: torch.Tensor  # [max_blocks * BLOCK_M] int32
    block_expert: torch.Tensor  # [max_blocks] int32
    acc: torch.Tensor  # [T, D] float32 zeros
    x_int8: tuple[torch.Tensor, torch.Tensor] | None  # ([T, D/4] int32, [T, D/32] float32)


def tile_per_pair_alignment(
    topk_ids: torch.Tensor, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouping with a tile per pair: (sorted_pairs, block_expert = the ids)."""
    pairs = topk_ids.numel()
    tiles = torch.full((pairs, block_m), pairs, dtype=torch.int32, device=topk_ids.device)
    tiles[:, 0] = torch.arange(pairs, dtype=torch.int32, device=topk_ids.device)
    return tiles.view(-1), topk_ids.reshape(-1).to(torch.int32)


def moe_prologue_reference(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    top_k: int,
    block_m: int,
    quantize_int8: bool,
    topk_ids: torch.Tensor | None = None,
    **routing,
) -> MoePrologueReference:
    """x [T, D], gate_weight [E, D] -> what moe_prologue computes; routing arguments as
    moe_route_reference's. `topk_ids` given (e.g. the kernel's own): the grouping is of
    those ids, so a near tie in the routing, where float32 sums in another order may pick
    another expert, does not make every later comparison fail. `tid2eid` and `token_ids`
    in `routing`: hash routing (moe_hash_route_reference), which takes no bias or groups."""
    t, d = x.shape
    e = gate_weight.shape[0]
    if routing.get("tid2eid") is not None:
        weights, ids = _hash_route(x, gate_weight, **routing)
    else:
        weights, ids = moe_gate_route_reference(x, gate_weight, top_k, **routing)
    group_ids = ids if topk_ids is None else topk_ids
    if block_m == 1 or t == 1:
        sorted_pairs, block_expert = tile_per_pair_alignment(group_ids, block_m)
    else:
        sorted_pairs, block_expert = moe_align_reference(group_ids, e, block_m)
    acc = torch.zeros(t, d, dtype=torch.float32, device=x.device)
    x_int8 = act_quant_int8_reference(x) if quantize_int8 else None
    return MoePrologueReference(weights, ids, sorted_pairs, block_expert, acc, x_int8)


def _hash_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    tid2eid: torch.Tensor,
    token_ids: torch.Tensor,
    bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    **scoring,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate in float32 (as moe_gate_route_reference), then the hash routing."""
    assert bias is None and n_group == 1, "hash routing takes no bias and no expert groups"
    logits = x.float() @ gate_weight.float().t()  # [T, E]
    return moe_hash_route_reference(logits, token_ids, tid2eid, **scoring)
