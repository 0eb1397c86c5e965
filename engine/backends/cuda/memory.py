"""How much GPU memory the KV cache gets: measured after warm-up forwards."""

from __future__ import annotations

import logging

import torch
from torch import nn

from engine.ops.attention_context import AttentionContext

log = logging.getLogger(__name__)

# Memory kept free besides what the warm-ups measure: cuBLAS workspaces, the small graphs'
# own bookkeeping, allocator fragmentation.
HEADROOM_BYTES = 512 << 20
FREE_MEMORY_SHARE = 0.9
# The graphs' pool against the eager decode warm-up's peak: capture keeps every graph's
# side-stream buffers apart where eager steps reuse them (H200, Moonlight shape, 1,024 rows:
# pool 1.21 GiB bf16 and 1.33 GiB FP8 + MXFP4 against a 0.94 GiB warm-up peak).
POOL_OVER_WARMUP = 1.5


def kv_cache_budget(
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    warmup_tokens: int,
    vocab_size: int,
    decode_rows: int,
    max_model_len: int,
) -> int:
    """Bytes for the KV cache, measured after two warm-up forwards over a temporary cache:
    a prefill of `warmup_tokens` tokens (the most one step computes: what eager steps
    need) and, with `decode_rows` > 0, a decode step of that many rows at the longest
    context (what the CUDA graphs' private pool holds: the largest bucket's activations
    and logits). Both peaks, the logprob graphs' extra logits and a headroom are kept
    free; the KV cache gets a share of the rest. A model with per-sequence state must
    have it bound already: the warm-ups use state slot 0."""
    blocks = -(-warmup_tokens // block_size) + 1
    temp = [
        torch.empty(blocks, *s.block_shape(block_size), dtype=s.dtype or dtype, device=device)
        for s in model.cache_specs()
    ]
    model.bind_kv_cache(temp)
    gen = torch.Generator(device=device).manual_seed(0)
    prefill_ctx = AttentionContext(
        block_size=block_size,
        slot_mapping=torch.arange(warmup_tokens, device=device),  # blocks 0.. in order
        cu_query_lens=torch.tensor([0, warmup_tokens], dtype=torch.int32, device=device),
        context_lens=torch.tensor([warmup_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None, :],
        query_lens_host=[warmup_tokens],
        context_lens_host=[warmup_tokens],
        is_decode=False,
        state_slots=torch.zeros(1, dtype=torch.int32, device=device),
        state_slots_host=[0],
    )
    prefill = _peak_bytes(model, device, warmup_tokens, vocab_size, prefill_ctx, gen, last=True)
    decode = 0
    if decode_rows:
        n = decode_rows
        max_blocks = -(-max_model_len // block_size)
        decode_ctx = AttentionContext(
            block_size=block_size,
            slot_mapping=torch.zeros(n, dtype=torch.long, device=device),
            cu_query_lens=torch.arange(n + 1, dtype=torch.int32, device=device),
            context_lens=torch.ones(n, dtype=torch.int32, device=device),
            # every row reads block 0; the host lengths are the graphs' worst case, which
            # sizes the attention's split scratch as a captured step does
            block_tables=torch.zeros(n, max_blocks, dtype=torch.int32, device=device),
            query_lens_host=[1] * n,
            context_lens_host=[max_model_len] * n,
            is_decode=True,
            state_slots=torch.zeros(n, dtype=torch.int32, device=device),
            state_slots_host=[0] * n,
        )
        decode = int(
            POOL_OVER_WARMUP
            * _peak_bytes(model, device, n, vocab_size, decode_ctx, gen, last=False)
        )
    del temp
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    # the logprob graphs' log-softmax and the sampler's float32 copy of the logits
    logits = 2 * decode_rows * vocab_size * 4
    budget = int(free * FREE_MEMORY_SHARE) - prefill - decode - logits - HEADROOM_BYTES
    log.info(
        "KV budget after warm-up: %.2f GiB free, prefill peak %.2f GiB, decode graphs' pool "
        "%.2f GiB (%d rows) -> %.2f GiB for KV",
        free / 2**30,
        prefill / 2**30,
        decode / 2**30,
        decode_rows,
        budget / 2**30,
    )
    return budget


def _peak_bytes(model, device, tokens: int, vocab_size: int, ctx, gen, last: bool) -> int:
    """Peak memory of one forward of `tokens` tokens and its logits (the last row's with
    `last`, else every row's, as a decode step computes) above what was allocated."""
    ids = torch.randint(0, vocab_size, (tokens,), device=device, generator=gen)
    positions = torch.arange(tokens, device=device) if last else torch.zeros_like(ids)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        hidden = model(ids, positions, ctx)
        model.compute_logits(hidden[-1:] if last else hidden)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del hidden
    return peak
