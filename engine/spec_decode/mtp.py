"""Draft tokens from the checkpoint's MTP layer (DeepSeek-V3 multi-token prediction).

Legend: T = rows of the step, B = sequences, K = drafts per sequence, D = hidden, V = vocab.

The MTP layer at position i reads the target's final hidden state h_i and the embedding
of the token at i+1, and predicts the token at i+2. It has its own latent KV cache (the
last entry of `model.cache_specs()`), addressed with the same block tables and slots as
the target's cache. Per step, for each sequence:

1. After the target's forward over rows at positions s..p (a prefill chunk, or the
   verified rows of a speculative step), run MTP over the same rows with `next_ids` =
   the tokens at s+1..p+1 (the last being the token just sampled / emitted). This writes
   the MTP cache for s..p and gives draft 1 from the last row.
2. Drafts 2..K: one decode row per sequence at position p+k-1 with the previous MTP
   output as hidden state and draft k-1 as the token, reusing the (only) MTP layer.
   These write MTP cache entries at p+1..p+K-1; they are speculative and get overwritten
   by step 1 of the next step for the positions that were accepted.

The scheduler must therefore have blocks for positions up to p+K (the verify forward
writes the target cache at p+1..p+K as well).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.ops.attention_context import AttentionContext

MAX_DRAFTS = 4


@dataclass
class DraftProposal:
    tokens: torch.Tensor  # [B, K] int64
    probs: torch.Tensor  # [B, K, V] float32: the distribution each draft was drawn from


def decode_context(
    block_tables: torch.Tensor, positions: torch.Tensor, block_size: int, like: AttentionContext
) -> AttentionContext:
    """A one-token-per-sequence context writing at `positions` [B] (context = pos + 1), for
    the sequences of `like` in its order (their state slots and batch-invariance mode)."""
    B = positions.shape[0]
    pos = positions.long()
    blocks = block_tables.long().gather(1, (pos // block_size)[:, None])[:, 0]
    lens = (pos + 1).to(torch.int32)
    return AttentionContext(
        block_size=block_size,
        slot_mapping=blocks * block_size + pos % block_size,
        cu_query_lens=torch.arange(B + 1, dtype=torch.int32, device=positions.device),
        context_lens=lens,
        block_tables=block_tables,
        query_lens_host=[1] * B,
        context_lens_host=lens.tolist(),
        is_decode=True,
        batch_invariant=like.batch_invariant,
        state_slots=like.state_slots,
        state_slots_host=like.state_slots_host,
    )


def draw_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor | None,
    generators: list[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], probs [B, V]): argmax with a one-hot distribution where
    the temperature is 0 (or temperatures is None), else a sample from softmax(l / t).

    Row i's draw comes from generators[i] alone (its sequence's own), so its drafts do not
    depend on the other rows of the batch; a row whose generator is None takes the argmax,
    and its distribution is that one-hot (the caller drops such rows' drafts). Without
    `generators`, every sampled row draws from the global generator."""
    greedy = logits.argmax(dim=-1)
    one_hot = torch.nn.functional.one_hot(greedy, logits.shape[-1]).float()
    if temperatures is None:
        return greedy, one_hot
    t = temperatures.float().clamp(min=1e-6)[:, None]
    probs = torch.softmax(logits.float() / t, dim=-1)
    is_greedy = temperatures <= 0
    if generators is None:
        sampled = torch.multinomial(probs, 1)[:, 0]
    else:
        sampled = greedy.clone()
        undrawn = [g is None for g in generators]
        for i, (generator, temp) in enumerate(zip(generators, temperatures.tolist())):
            if generator is not None and temp > 0:
                sampled[i] = torch.multinomial(probs[i : i + 1], 1, generator=generator)[0, 0]
        is_greedy = is_greedy | torch.tensor(undrawn, device=logits.device)
    return (
        torch.where(is_greedy, greedy, sampled),
        torch.where(is_greedy[:, None], one_hot, probs),
    )


class MtpDrafter:
    def __init__(self, model, num_draft_tokens: int) -> None:
        if not 1 <= num_draft_tokens <= MAX_DRAFTS:
            raise ValueError(f"num_draft_tokens must be in 1..{MAX_DRAFTS}, got {num_draft_tokens}")
        if getattr(model, "num_mtp_layers", 0) < 1:
            raise ValueError(
                "the model has no MTP layer loaded (config.json num_nextn_predict_layers = 0, "
                "the checkpoint lacks it, or enable_mtp=False)"
            )
        self.model = model
        self.num_draft_tokens = num_draft_tokens

    @torch.no_grad()
    def propose(
        self,
        target_hidden: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        temperatures: torch.Tensor | None = None,
        generators: list[torch.Generator | None] | None = None,
    ) -> DraftProposal:
        """target_hidden [T, ...] (the target forward's output rows: [T, D] for V3, the
        final streams [T, C, D] for V4), next_ids [T] (the token after each row), positions
        [T] and ctx of those rows; `generators`: draw_tokens'. Returns K drafts per
        sequence."""
        model, depths = self.model, self.model.num_mtp_layers
        hidden = model.mtp_forward(target_hidden, next_ids, positions, ctx, depth=0)  # [T, ...]
        last = (ctx.cu_query_lens[1:] - 1).long()  # [B]
        hidden = hidden[last]  # [B, ...]
        pos = positions[last]
        token, probs = draw_tokens(model.mtp_logits(hidden, 0), temperatures, generators)
        tokens, dists = [token], [probs]
        for k in range(1, self.num_draft_tokens):
            depth = min(k, depths - 1)
            step_ctx = decode_context(ctx.block_tables, pos + k, ctx.block_size, ctx)
            hidden = model.mtp_forward(hidden, tokens[-1], pos + k, step_ctx, depth=depth)
            token, probs = draw_tokens(model.mtp_logits(hidden, depth), temperatures, generators)
            tokens.append(token)
            dists.append(probs)
        return DraftProposal(torch.stack(tokens, dim=1), torch.stack(dists, dim=1))
