"""What every model family gives the engine.

A family is a `CausalLM` subclass registered under its architecture names
(engine/models/registry.py). The model runner owns the KV cache and the per-step
`AttentionContext`; the model only reads them. Legend for shape comments across families:
T = tokens in this step (all sequences, flattened), B = sequences, D = hidden size,
H = attention heads, V = vocabulary.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.ops.attention_context import AttentionContext


@dataclass(frozen=True)
class CacheSpec:
    """The per-token cache entry of one attention layer: the runner allocates
    [num_blocks, block_size, *shape] of `dtype` for it (None: the model's dtype)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    def bytes_per_token(self, default_dtype: torch.dtype) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * (self.dtype or default_dtype).itemsize


class CausalLM(nn.Module, ABC):
    """A decoder-only model over a paged KV cache.

    `forward` takes the flattened tokens of every sequence in the step and their absolute
    positions; attention layers find their sequence boundaries, cache slots and block
    tables in `ctx`. It returns hidden states; `compute_logits` turns the rows the sampler
    needs into float32 logits.
    """

    config: object

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor: ...

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def cache_specs(self) -> list[CacheSpec]:
        """One entry per attention layer, in layer order."""

    @abstractmethod
    def bind_kv_cache(self, caches: list[torch.Tensor]) -> None:
        """Give each attention layer its cache tensor (same order as cache_specs)."""

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into parameters. Strict: a name
        with no parameter, or a parameter never filled, raises naming them."""

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))
