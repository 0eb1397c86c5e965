"""How much GPU memory the KV cache gets: measured after a warm-up forward."""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.ops.attention_context import AttentionContext

log = logging.getLogger(__name__)

# Memory kept free after the KV cache: CUDA graphs' pool (largest bucket's activations and
# logits), cuBLAS workspaces, allocator fragmentation.
GRAPH_HEADROOM_BYTES = 1 << 30
FREE_MEMORY_SHARE = 0.9


def kv_cache_budget(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    warmup_tokens: int,
    vocab_size: int,
    max_num_seqs: int,
) -> int:
    """Bytes for the KV cache, measured after a warm-up forward: a prefill of
    `warmup_tokens` tokens (the most one step computes) over a temporary cache. What the
    warm-up peaked at, the graphs' headroom and the logits of the largest decode batch
    are kept free; the KV cache gets a share of the rest. A model with per-sequence state
    must have it bound already: the warm-up sequence uses state slot 0."""
    blocks = -(-warmup_tokens // block_size) + 1
    temp = [
        torch.empty(blocks, *s.block_shape(block_size), dtype=s.dtype or dtype, device=device)
        for s in model.cache_specs()
    ]
    model.bind_kv_cache(temp)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab_size, (warmup_tokens,), device=device, generator=gen)
    positions = torch.arange(warmup_tokens, device=device)
    ctx = AttentionContext(
        block_size=block_size,
        slot_mapping=positions.clone(),  # blocks 0.. of the temporary cache, in order
        cu_query_lens=torch.tensor([0, warmup_tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([warmup_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None, :],
        query_lens_host=[warmup_tokens],
        context_lens_host=[warmup_tokens],
        is_decode=False,
        state_slots=torch.zeros(1, dtype=torch.int32, device=device),
        state_slots_host=[0],
    )
    with torch.inference_mode():
        hidden = model(ids, positions, ctx)
        model.compute_logits(hidden[-1:])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del temp, hidden
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    logits = 3 * max_num_seqs * vocab_size * 4  # float32 logits, their copy, sampler scratch
    budget = int(free * FREE_MEMORY_SHARE) - peak - GRAPH_HEADROOM_BYTES - logits
    log.info(
        "KV budget after warm-up: %.2f GiB free, warm-up peak %.2f GiB -> %.2f GiB for KV",
        free / 2**30,
        peak / 2**30,
        budget / 2**30,
    )
    return budget
