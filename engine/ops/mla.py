"""Multi-head latent attention's arithmetic: the interface and its torch implementation.

Legend: docs/shapes.md. Per token the cache holds only c = kv_a_layernorm(first R of
kv_a_proj_with_mqa(x)) and the roped shared key k_rope (P values): R + P values per token
per layer (576 for V3). `MultiLatentAttention.mode` picks "auto" (the cheaper form per
sequence by a flop count), "absorbed" or "expanded" (engine/ops/mla_forms.py).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod

import torch

from engine.ops.attention_context import AttentionContext
from engine.ops.device_layer import DeviceSetup, register
from engine.ops.mla_forms import (
    attend_absorbed_batched,
    attend_expanded_batched,
    expanded_groups,
    pack_to_device,
    write_latent_cache,
)

MODES = ("auto", "absorbed", "expanded")
# Keys and values one batched expanded-form call may hold (its group's padded contexts;
# in float32 Moonlight: ~18K tokens, V3 with 128 heads: ~2K; twice that in bf16).
EXPANDED_GROUP_BYTES = 512 << 20


class MlaOps(ABC):
    @abstractmethod
    def forward(
        self, attn, x: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """x [T, D] -> the attention output after o_proj, [T, D]; writes the step's new
        cache entries."""

    def forward_with_input_norm(
        self,
        attn,
        norm,
        x: torch.Tensor,
        residual: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """norm(x, residual) and then the attention in fewer launches, as (attention
        output, x + residual); None where the device has no such path for this step."""
        return None


class TorchMlaOps(MlaOps):
    """`expanded_dtype`: what the expanded form computes keys, values and attention in.
    `invariant_forms`: batch-invariant steps (ctx.batch_invariant) take the absorbed form
    for every query; a backend whose kernels are not batch-invariant turns it off."""

    def __init__(self, expanded_dtype: torch.dtype = torch.float32, invariant_forms: bool = True):
        self.expanded_dtype = expanded_dtype
        self.invariant_forms = invariant_forms

    def forward(self, attn, x, positions, ctx):
        check_ready(attn)
        q = self.project(attn, x, positions, ctx)
        out = self.attend(attn, q, positions, ctx)  # [T, H, V] in x's dtype
        return attn.o_proj(out.reshape(x.shape[0], -1))

    def project(self, attn, x, positions, ctx: AttentionContext) -> torch.Tensor:
        """q [T, H, N+P] with its rope slice rotated; the new tokens' [c | k_rope] written
        into the cache."""
        d = attn.dims
        T, H, N, R = x.shape[0], d.num_heads, d.qk_nope_head_dim, d.kv_lora_rank
        if d.q_lora_rank:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        else:
            q = attn.q_proj(x)
        q = q.view(T, H, N + d.qk_rope_head_dim)
        kv = attn.kv_a_proj_with_mqa(x)  # [T, R+P]
        latent = attn.kv_a_layernorm(kv[:, :R].contiguous())
        q_rope, k_rope = attn.rotary(positions, q[..., N:], kv[:, None, R:])
        q[..., N:] = q_rope  # one q [T, H, N+P] for the attention forms to gather once
        write_latent_cache(attn.kv_cache, ctx, latent, k_rope[:, 0])
        return q

    def attend(
        self, attn, q: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """q [T, H, N+P], rope applied. Sequences that take the absorbed form run batched
        (padded to the longest query chunk among them); the rest run in the expanded form,
        batched in groups of similar context length (expanded_groups)."""
        d = attn.dims
        w = attn.kv_b_weight().float()
        # In the model's dtype: the forms compute in float32 (or expanded_dtype) and their
        # rows are rounded once, as they are copied in; q is cast only where a form needs it.
        out = q.new_empty(q.shape[0], d.num_heads, d.v_head_dim)
        q_lens, c_lens = ctx.query_lens_host, ctx.context_lens_host
        starts = [0, *itertools.accumulate(q_lens)]  # the host's copy of cu_query_lens

        def expanded(b: int) -> bool:
            if attn.mode != "auto":
                return attn.mode == "expanded"
            # Batch-invariant, the torch path takes the absorbed form for every query: a
            # query's result is then the same in a prefill chunk of any size as in decode.
            invariant = ctx.batch_invariant and self.invariant_forms
            return not invariant and d.prefer_expanded(q_lens[b], c_lens[b])

        def indices(seqs: list[int]) -> tuple[torch.Tensor, ...]:
            # The index tensors are built on the host by a few vectorized ops and sent in
            # one asynchronous copy, and the longest context is passed from the host:
            # every blocking copy or .max() makes the host wait for the GPU.
            lens = torch.tensor([q_lens[b] for b in seqs])
            steps = torch.arange(int(lens.max()))
            first = torch.tensor([starts[b] for b in seqs])
            # row of each (sequence, query) pair; padding repeats the last real row
            rows = first[:, None] + torch.minimum(steps[None, :], lens[:, None] - 1)  # [B', Q]
            real = steps[None, :] < lens[:, None]
            picked = real.flatten().nonzero().squeeze(1)  # the real pairs among the rows
            parts = (torch.tensor(seqs), rows.flatten(), picked, rows[real])
            on, rows_d, picked_d, dest = pack_to_device(parts, q.device)
            rows_d = rows_d.view(rows.shape)
            tables, lens_d = ctx.block_tables[on], ctx.context_lens[on].long()
            return rows_d, positions[rows_d], tables, lens_d, picked_d, dest

        def run(attend, seqs: list[int], **options) -> None:
            # Every layer of the step groups the same sequences alike: the indices are built
            # and copied once per step (per layer, the copy through pinned memory would be
            # the top host wait of a 128-prompt prefill step on the H200). A context
            # is one step's: its positions, tables and lengths are the same for each layer.
            rows_d, pos, tables, lens_d, picked_d, dest = ctx.shared(
                ("mla-rows", tuple(seqs)), lambda: indices(seqs)
            )
            o = attend(q[rows_d], pos, attn.kv_cache, tables, lens_d, w, d, attn.scale,
                       max_context=max(c_lens[b] for b in seqs), **options)  # fmt: skip
            out.index_copy_(0, dest, o.flatten(0, 1).index_select(0, picked_d).to(out.dtype))

        absorbed = [b for b in range(ctx.num_seqs) if not expanded(b)]
        if absorbed:
            run(attend_absorbed_batched, absorbed)
        rest = [b for b in range(ctx.num_seqs) if expanded(b)]
        # keys and values of every context token: ~(2N+P+V) H elements each
        per_token = (
            self.expanded_dtype.itemsize
            * d.num_heads
            * (2 * d.qk_nope_head_dim + d.qk_rope_head_dim + d.v_head_dim)
        )
        budget = max(1, EXPANDED_GROUP_BYTES // per_token)
        for group in expanded_groups(rest, c_lens, q_lens, budget):
            run(attend_expanded_batched, group, dtype=self.expanded_dtype)
        return out


def check_ready(attn) -> None:
    if attn.mode not in MODES:
        raise ValueError(f"MLA mode {attn.mode!r}: expected one of {MODES}")
    if attn.kv_cache is None:
        raise RuntimeError("MLA layer has no KV cache: call model.bind_kv_cache first")


TORCH_MLA = TorchMlaOps()


@register("mla", "cpu")
def torch_mla_ops(attn, setup: DeviceSetup) -> MlaOps:
    return TORCH_MLA
