"""Torch twin of kernels/triton/moe_align.py: (token, expert) pairs grouped by expert, each
expert's run padded to whole tiles of BLOCK_M rows.

Legend: docs/shapes.md (T tokens, K experts per token, E experts). Pair p = t*K + k is
token t's k-th choice. The layout the fused MoE kernels read:
  sorted_pairs [max_blocks * BLOCK_M] int32: expert 0's pairs in pair order, pads up to
    a multiple of BLOCK_M, then expert 1's, ...; a pad slot holds T*K; slots past the
    last expert's run are pads too
  block_expert [max_blocks] int32: the expert of each tile, -1 past the last run
  max_blocks = ceil((T*K + min(E, T*K) * (BLOCK_M - 1)) / BLOCK_M), known on the host
A chain of small ops with no host sync (bincount would read max() back; scatter_add into
E bins does not), so it also captures into a CUDA graph.
"""

from __future__ import annotations

import torch


def moe_align_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, K] (any int dtype, values in [0, E)) -> (sorted_pairs, block_expert)."""
    assert topk_ids.dim() == 2, f"topk_ids must be [T, K], got {list(topk_ids.shape)}"
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)  # [T*K]
    pairs = flat.numel()
    max_padded = pairs + min(num_experts, pairs) * (block_m - 1)
    max_blocks = -(-max_padded // block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # [E]
    padded = (counts + block_m - 1) // block_m * block_m  # [E]
    padded_end = torch.cumsum(padded, 0)  # [E]
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # [T*K] pairs grouped by expert
    expert_of = flat[order]
    rank = torch.arange(pairs, device=device) - count_start[expert_of]
    dest = padded_start[expert_of] + rank  # [T*K]
    sorted_pairs = torch.full((max_blocks * block_m,), pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True)  # [max_blocks]
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert
