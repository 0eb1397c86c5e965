"""Continuous batching: which sequences run in the next step, and how many tokens each.

A step mixes decode tokens (one per running sequence) with prefill chunks, under
max_num_batched_tokens. When the cache runs out, the most recently admitted sequence
is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed later (its generated tokens are kept, so nothing is lost).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # new tokens computed for each sequence this step

    @property
    def is_decode(self) -> bool:
        return all(
            n == 1 and s.num_computed == len(s) - 1 for s, n in zip(self.seqs, self.num_tokens)
        )


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lookahead_slots: int = 0,
    ):
        self.blocks = blocks
        # extra cache positions each running sequence keeps ahead of its tokens
        # (speculative drafts and the draft model's own cache writes)
        self.lookahead_slots = lookahead_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []

        # Running sequences first, oldest first: each continues its prefill or decodes.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.draft_tokens and seq.num_uncomputed + len(seq.draft_tokens) > budget:
                seq.draft_tokens, seq.draft_probs = [], None  # drafts are optional
            n = min(seq.num_uncomputed + len(seq.draft_tokens), budget)
            while not self.blocks.can_grow(seq, self._needed(seq, n)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                break  # seq itself was preempted: nothing later can run either
            self.blocks.grow(seq, self._needed(seq, n))
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1

        # Then admit waiting sequences while there is room, preferring the group that
        # dominates the running batch (a task cluster routes to overlapping experts).
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_waiting()
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.can_grow(seq, self._needed(seq, n)):
                break
            self._take_waiting(seq)
            self.blocks.grow(seq, self._needed(seq, n))
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def _needed(self, seq: Sequence, n: int) -> int:
        """Cache positions the sequence must own to run n more rows this step."""
        return seq.num_computed + n + self.lookahead_slots

    def _next_waiting(self) -> Sequence:
        head = self.waiting[0]
        if head.num_computed or head.num_output_tokens or not self.running:
            return head  # preempted sequences go first; no preference without a batch
        groups = Counter(s.group for s in self.running if s.group is not None)
        if not groups:
            return head
        dominant = groups.most_common(1)[0][0]
        if head.group == dominant:
            return head
        # Look a bounded way ahead so admission stays O(1)-ish per step.
        for k, seq in enumerate(self.waiting):
            if k >= 256:
                break
            if seq.group == dominant:
                return seq
        return head

    def _take_waiting(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.draft_tokens, seq.draft_probs = [], None
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """End a sequence: running ones free their blocks; a waiting one (preempted while
        its last token was still being sampled) only leaves the queue."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
            self.blocks.release(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def abort_unrunnable(self) -> list[Sequence]:
        """Waiting sequences that can never fit the whole cache: nothing else to do with
        them than to fail them (the caller reports the error)."""
        capacity = self.blocks.num_blocks * self.blocks.block_size
        bad = [s for s in self.waiting if len(s) + 1 + self.lookahead_slots > capacity]
        for s in bad:
            self.waiting.remove(s)
            s.status = Status.FINISHED
        return bad
