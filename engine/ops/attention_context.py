"""Per-step attention metadata, built by the model runner and read by attention layers.

Tokens of all sequences in a step are flattened: sequence b owns rows
cu_query_lens[b]:cu_query_lens[b+1]. Its KV cache lives in the blocks listed in
block_tables[b]; token t of the sequence is stored at slot
block_tables[b][t // block_size] * block_size + t % block_size. A model with fixed
per-sequence state (CausalLM.state_specs) finds sequence b's in slot state_slots[b].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionContext:
    block_size: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot each new token is written to
    cu_query_lens: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32: cached tokens after this step (incl. the new ones)
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_host: list[int]  # same as the diff of cu_query_lens, on the host (no sync)
    context_lens_host: list[int]
    is_decode: bool  # every sequence has exactly one new token
    # Attention whose result for a query does not depend on the step's other queries, its
    # chunking or padding (docs/batch-invariance.md); False takes faster fused forms.
    batch_invariant: bool = True
    state_slots: torch.Tensor | None = None  # [B] int32: each sequence's state slot
    state_slots_host: list[int] | None = None
    # Derived tensors every layer needs alike, computed on first use and shared by all
    # layers of the step (a decoder has tens of layers; recomputing them per layer costs
    # more than the attention itself at small batch).
    _cache: dict = field(default_factory=dict, repr=False)

    def shared(self, key, make):
        value = self._cache.get(key)
        if value is None:
            value = self._cache[key] = make()
        return value

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_host) if self.context_lens_host else 0
