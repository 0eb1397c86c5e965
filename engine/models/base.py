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


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel


@dataclass(frozen=True)
class CacheSpec:
    """A paged cache of one attention layer, one entry per `tokens_per_entry` tokens of
    context (1: every token; V4's compressed caches: one per compress ratio). The runner
    allocates [num_blocks, block_size // tokens_per_entry, *shape] of `dtype` (None: the
    model's dtype), with block_size a multiple of every spec's tokens_per_entry; entry w
    of a sequence lies in its block `w * tokens_per_entry // block_size`."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    tokens_per_entry: int = 1

    def bytes_per_token(self, default_dtype: torch.dtype) -> float:
        return self.bytes_per_block(self.tokens_per_entry, default_dtype) / self.tokens_per_entry

    def bytes_per_block(self, block_size: int, default_dtype: torch.dtype) -> int:
        entries = block_size // self.tokens_per_entry
        return entries * _numel(self.shape) * (self.dtype or default_dtype).itemsize

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        """One block's entries: [block_size // tokens_per_entry, *shape]."""
        return (block_size // self.tokens_per_entry, *self.shape)


@dataclass(frozen=True)
class StateSpec:
    """Fixed-size state every running sequence holds, whatever its length (V4's window
    ring and compression pooling state): the runner allocates [num_slots, *shape] of
    `dtype` (None: the model's dtype), and each running sequence owns one slot."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None

    def bytes_per_sequence(self, default_dtype: torch.dtype) -> int:
        return _numel(self.shape) * (self.dtype or default_dtype).itemsize


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

    def state_specs(self) -> list[StateSpec]:
        """The fixed per-sequence state, in the order `bind_state` takes it (none by
        default: a model whose whole decode state is its paged caches)."""
        return []

    def bind_state(self, states: list[torch.Tensor]) -> None:
        """Give the layers their state tensors [num_slots, *shape] (same order as
        state_specs); AttentionContext.state_slots says which slot a sequence owns."""
        if states:
            raise ValueError(f"{type(self).__name__} takes no per-sequence state")

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into parameters. Strict: a name
        with no parameter, or a parameter never filled, raises naming them."""

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 2048))
