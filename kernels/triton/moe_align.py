"""Group (token, expert) pairs by expert for the fused MoE kernels.

Legend: T = tokens, A = experts per token (top-k), P = T*A pairs, E = experts,
BM = the kernel's BLOCK_M. Pair p = t*A + a is token t's a-th choice.

The result pads each expert's pairs to a multiple of BM so every BLOCK_M tile of
`sorted_pairs` belongs to one expert. Every size is computed from host-known T, A, E, BM
(never read back from the device), so the step is CUDA-graph capturable and syncs nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoeAlignment:
    sorted_pairs: torch.Tensor  # [max_padded] int32: pair ids grouped by expert, pad = P
    block_expert: torch.Tensor  # [max_blocks] int32: expert of each BM tile, -1 = unused
    num_pairs: int  # P
    block_m: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """At most min(E, P) experts are hit, each padding at most BM-1 slots."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeAlignment:
    """topk_ids [T, A] (any int dtype, values in [0, E)) -> MoeAlignment."""
    assert topk_ids.dim() == 2, f"topk_ids must be [T, A], got {list(topk_ids.shape)}"
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [P]
    p = flat.numel()
    max_padded = max_padded_pairs(p, num_experts, block_m)
    max_blocks = -(-max_padded // block_m)
    # bincount would sync (it reads max() back); scatter_add into E bins does not.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # [P] pairs grouped by expert
    expert_of = flat[order]
    rank = torch.arange(p, device=device) - count_start[expert_of]
    dest = padded_start[expert_of] + rank  # [P]
    sorted_pairs = torch.full((max_blocks * block_m,), p, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # [max_blocks]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoeAlignment(sorted_pairs, block_expert, p, block_m)
