"""MTP speculative decoding inside continuous batching.

Per step, every scheduled sequence runs its rows through the target model: prefill
chunks as usual, and for a decoding sequence with drafts, its last token followed by its
K drafts (K+1 rows at positions p..p+K). Then:

1. Emitted tokens: a sequence whose prompt chunk ends this step samples one token; a
   sequence with drafts verifies them (greedy: exact match with the target's argmax;
   sampled: rejection sampling, so the output distribution is the target's) and emits
   the accepted drafts plus one correction / bonus token.
2. Only rows whose tokens are confirmed stay valid: the cache entries of rejected drafts
   are simply overwritten later (num_computed stops after the last accepted row).
3. The MTP layer runs over the valid rows (its own cache gets those positions) with each
   row's confirmed next token, and proposes K drafts for every sequence that emitted.

The scheduler gives each running sequence blocks for K extra positions (drafts and the
MTP layer's speculative cache writes). A model with fixed per-sequence state (V4's window
rings and pooling rows, overwritten in place) sizes it for K drafts through
`reserve_lookahead(K)`, called here, before the model runner allocates that state.

The speculator gets what it uses, not the model runner: the model (the target's forward
and logits, and its MTP layer), the function that flattens a step's rows into inputs and
an attention context, the per-sequence token ban (min_tokens) and the context length.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.ops.attention_context import AttentionContext
from engine.sampler import filter_logits, prepare_logits, sample, token_logprobs
from engine.sequence import Sequence
from engine.spec_decode.acceptance import AcceptanceStats, greedy_accept, rejection_sample
from engine.spec_decode.mtp import MtpDrafter

if TYPE_CHECKING:
    from engine.models.base import CausalLM
    from engine.scheduler import ScheduledBatch

# (sequence, first position, number of rows) per sequence -> (input_ids [T], positions [T],
# the attention context of those rows)
BuildInputs = Callable[
    [list[tuple[Sequence, int, int]]], tuple[torch.Tensor, torch.Tensor, AttentionContext]
]


class MtpSpeculator:
    def __init__(
        self,
        model: CausalLM,
        num_draft_tokens: int,
        *,
        build_inputs: BuildInputs,
        banned_tokens: Callable[[Sequence], list[int]],
        max_model_len: int,
    ) -> None:
        self.model = model
        self.num_draft_tokens = num_draft_tokens
        self.build_inputs = build_inputs
        self.banned_tokens = banned_tokens
        self.max_model_len = max_model_len
        self.drafter = MtpDrafter(model, num_draft_tokens)
        reserve = getattr(model, "reserve_lookahead", None)
        if reserve is not None:
            reserve(num_draft_tokens)
        self.stats = AcceptanceStats()

    def run(self, batch: ScheduledBatch) -> dict[int, list[int]]:
        model = self.model
        # a sequence's rows: its uncomputed tokens, then its drafts
        items = [(s, s.num_computed, n) for s, n in zip(batch.seqs, batch.num_tokens)]
        input_ids, positions, ctx = self.build_inputs(items)
        hidden = model(input_ids, positions, ctx)  # [T, ...]: what compute_logits reads
        emitted: dict[int, list[int]] = {}
        valid_items: list[tuple[Sequence, int, int]] = []
        valid_rows: list[int] = []
        next_ids: list[int] = []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed
            rows = torch.arange(row, row + n, device=hidden.device)
            new = self._emit(seq, start, n, hidden, rows)
            confirmed = seq.token_ids + new
            valid = min(n, len(confirmed) - 1 - start)
            valid_items.append((seq, start, valid))
            valid_rows.extend(range(row, row + valid))
            next_ids.extend(confirmed[start + 1 : start + valid + 1])
            seq.num_computed = start + valid
            seq.draft_tokens, seq.draft_probs = [], None
            if new:
                emitted[seq.seq_id] = new
            row += n
        self._propose(batch, hidden, valid_items, valid_rows, next_ids, emitted)
        return emitted

    def _emit(self, seq: Sequence, start: int, n: int, hidden, rows) -> list[int]:
        """Tokens this sequence emits this step (none while its prompt chunk is unfinished).
        A grammar keeps only its valid drafts (accepted in turn, then rolled back) and
        masks every verified row, so an emitted token is always grammar-valid."""
        drafts = seq.draft_tokens
        if start + n - len(drafts) < len(seq):
            return []  # mid-prefill chunk
        k = len(drafts)
        raw = self.model.compute_logits(hidden[rows[-(k + 1) :]])  # [K+1, V]
        masks = None
        if seq.grammar is not None:
            masks, k = self._grammar_masks(seq, raw.shape[-1])
            raw = raw[: k + 1]
        if k == 0:
            tokens = self._sample_one(seq, raw, masks)
        else:
            tokens = self._verify(seq, drafts[:k], raw, masks)
        if seq.params.logprobs is not None:
            entries = token_logprobs(raw, tokens, [seq.params.logprobs] * len(tokens))
            for j, entry in enumerate(entries):
                seq.logprobs[seq.num_output_tokens + j] = entry
        return tokens

    def _grammar_masks(self, seq: Sequence, vocab: int) -> tuple[torch.Tensor, int]:
        """(bitmask [k+1, W] for the sequence's next position and after each of its first
        k drafts, k): the drafts kept are those up to the first the grammar refuses."""
        grammar = seq.grammar
        grammar.sync(seq.output_token_ids)
        masks = torch.full((len(seq.draft_tokens) + 1, -(-vocab // 32)), -1, dtype=torch.int32)
        grammar.fill(masks, 0)
        k = 0
        for draft in seq.draft_tokens:
            if not grammar.try_accept(draft):
                break
            k += 1
            grammar.fill(masks, k)
        grammar.rollback(k)
        return masks[: k + 1], k

    def _prepared(self, seq: Sequence, raw: torch.Tensor, masks, drafts: list[int]):
        """Row j's logits after the penalties (counting drafts[:j] as generated), the
        grammar mask and the token ban."""
        rows = raw.shape[0]
        outputs = seq.output_token_ids
        history = [outputs + drafts[:j] for j in range(rows)] if seq.params.penalized else None
        return prepare_logits(
            raw,
            [seq.params] * rows,
            history,
            masks,
            [True] * rows if masks is not None else None,
            [self.banned_tokens(seq)] * rows,
        )

    def _sample_one(self, seq: Sequence, raw: torch.Tensor, masks) -> list[int]:
        logits = self._prepared(seq, raw, masks, [])  # raw: the one row after the last token
        return sample(logits, [seq.params], [seq.sample_seed or 0], [seq.num_output_tokens])

    def _verify(self, seq: Sequence, drafts: list[int], raw: torch.Tensor, masks) -> list[int]:
        logits = self._prepared(seq, raw, masks, drafts)  # [K+1, V]
        draft = torch.tensor([drafts], device=logits.device)
        if seq.params.greedy:
            result = greedy_accept(draft, logits[None])
        else:
            target = torch.stack([filter_logits(row, seq.params) for row in logits])
            result = rejection_sample(
                draft,
                seq.draft_probs[None, : len(drafts)],
                target[None],
                generator=seq.generator(logits.device),
            )
        self.stats.update(result)
        return result.tokens[0]

    def _propose(self, batch, hidden, valid_items, valid_rows, next_ids, emitted) -> None:
        items = [(s, start, n) for s, start, n in valid_items if n > 0]
        if not items:
            return
        _, positions, ctx = self.build_inputs(items)
        rows = torch.tensor(valid_rows, device=hidden.device)
        temps = torch.tensor([s.params.temperature for s, _, _ in items], device=hidden.device)
        # No drafts while min_tokens bans EOS/stop ids: verification (greedy_accept,
        # rejection_sample) does not apply the ban, so a drafted EOS could be accepted.
        keeps = [seq.seq_id in emitted and not self.banned_tokens(seq) for seq, _, _ in items]
        # Only sequences that keep their drafts draw, each from its own generator: how often
        # a sequence is in a proposal (a prompt chunk that emits nothing is too) depends on
        # its neighbours, and its draws must not.
        generators = [
            seq.generator(hidden.device) if keep else None
            for (seq, _, _), keep in zip(items, keeps)
        ]
        proposal = self.drafter.propose(
            hidden[rows],
            torch.tensor(next_ids, device=hidden.device),
            positions,
            ctx,
            temperatures=None if bool((temps == 0).all()) else temps,
            generators=generators,
        )
        for b, ((seq, _, _), keep) in enumerate(zip(items, keeps)):
            if not keep:
                continue
            new = len(emitted[seq.seq_id])
            room = self.max_model_len - 1 - (len(seq) + new)
            left = seq.params.max_tokens - (seq.num_output_tokens + new)  # tokens still allowed
            k = max(0, min(self.num_draft_tokens, room, left - 1))
            seq.draft_tokens = proposal.tokens[b, :k].tolist()
            seq.draft_probs = proposal.probs[b, :k]
