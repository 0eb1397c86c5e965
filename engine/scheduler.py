"""Continuous batching: which sequences run in the next step, and how many tokens each.

Two policies, both under max_num_batched_tokens:
- mixed (the default): a step mixes decode tokens (one per running sequence) with
  prefill chunks, admitting waiting sequences whenever a slot is free;
- separate_prefill: a step is all decode or all prefill. Where decode steps replay CUDA
  graphs (engine/cuda_graph_runner.py) only a pure decode step can: a mixed one runs
  eagerly, and a step that admits a sequence whenever one finishes would make nearly every
  step of a long job mixed. So waiting sequences are admitted in prefill-only steps, in
  groups of at least min_prefill_seqs (fewer when that many are not waiting, or when
  nothing runs): a prefill step's fixed cost (its host launches) is paid once per group,
  while the freed slots idle for a few decode steps. A prefill chunked over several steps
  finishes before decoding resumes.

`Scheduler.for_engine` picks the policy from the engine's settings: separate_prefill where
decode steps replay CUDA graphs unless the config says otherwise, in groups of half the
slots by default (`default_min_prefill_seqs`).

When the cache runs out, the most recently admitted sequence is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later (its generated
tokens are kept, so nothing is lost).

With prefix caching (engine/prefix_cache.py) a waiting sequence is admitted at the cached
blocks its tokens start with and computes only the rest; one whose next uncached block a
running sequence is computing now waits (it reads that block a step later instead of
computing it too), so the first of the rows sharing a prefix prefills it for the others.
Each step starts by committing the blocks the previous steps filled.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.sequence import Sequence, Status


def default_min_prefill_seqs(max_num_seqs: int) -> int:
    """Half the slots: a prefill step's fixed cost (its host launches, ~100 ms at a few
    thousand tokens on the H200) is paid once per group, against slots idling while the
    group fills; half balances the two best end to end (docs/notes-gpu-engine.md has the
    group sizes measured)."""
    return max(1, max_num_seqs // 2)


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # new tokens computed for each sequence this step

    @property
    def is_decode(self) -> bool:
        return all(
            n == 1 and s.num_computed == len(s) - 1 for s, n in zip(self.seqs, self.num_tokens)
        )

    def keep(self, wanted) -> ScheduledBatch:
        """The batch without the sequences `wanted(seq)` is false for (itself when none)."""
        keep = [i for i, s in enumerate(self.seqs) if wanted(s)]
        if len(keep) == len(self.seqs):
            return self
        return ScheduledBatch([self.seqs[i] for i in keep], [self.num_tokens[i] for i in keep])


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lookahead_slots: int = 0,
        separate_prefill: bool = False,
        min_prefill_seqs: int = 1,
    ):
        if min_prefill_seqs < 1:
            raise ValueError(f"min_prefill_seqs must be >= 1, got {min_prefill_seqs}")
        self.blocks = blocks
        # extra cache positions each running sequence keeps ahead of its tokens
        # (speculative drafts and the draft model's own cache writes)
        self.lookahead_slots = lookahead_slots
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.separate_prefill = separate_prefill
        self.min_prefill_seqs = min_prefill_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @classmethod
    def for_engine(
        cls, config: EngineConfig, blocks: BlockManager, decode_graphs: bool
    ) -> Scheduler:
        """The engine's scheduler: separate_prefill None means on exactly when decode steps
        replay CUDA graphs (a mixed step cannot), min_prefill_seqs None half the slots, and
        each sequence keeps cache room for its speculative drafts."""
        separate = decode_graphs if config.separate_prefill is None else config.separate_prefill
        return cls(
            blocks,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            lookahead_slots=config.speculative_tokens,
            separate_prefill=separate,
            min_prefill_seqs=config.min_prefill_seqs
            or default_min_prefill_seqs(config.max_num_seqs),
        )

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        for seq in self.running:  # the blocks the last steps filled become shareable
            self.blocks.commit(seq)
        if not self.separate_prefill:
            return self._schedule(self.running, admit=True)
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        if prefilling or self._admission_due():
            batch = self._schedule(prefilling, admit=True)
            if batch.seqs:
                return batch
            # the cache holds no newcomer now: decode, which frees it as sequences finish
        return self._schedule(self.running, admit=False)

    def _admission_due(self) -> bool:
        """Whether a prefill step should admit waiting sequences now (separate_prefill)."""
        free = self.max_num_seqs - len(self.running)
        if not self.waiting or free < 1:
            return False
        return not self.running or free >= min(self.min_prefill_seqs, len(self.waiting))

    def _schedule(self, candidates: list[Sequence], admit: bool) -> ScheduledBatch:
        """`candidates` (running sequences, oldest first) continue their prefill or decode,
        then, with `admit`, waiting sequences join while there is room."""
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []

        # Running sequences first, oldest first: each continues its prefill or decodes.
        for seq in list(candidates):
            if budget <= 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted for an earlier one of this step
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

        # Then admit waiting sequences while there is room, preferring the group that
        # dominates the running batch (a task cluster routes to overlapping experts).
        held_back: set[int] = set()  # waiting for a prefix: admissions only add to those
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_waiting(held_back)
            if seq is None:
                break  # each candidate waits for a prefix a running sequence is computing
            prefix = self.blocks.cached_prefix(seq)
            start = len(prefix) * self.blocks.block_size if prefix else seq.num_computed
            n = min(len(seq) - start, budget)
            needed = start + n + self.lookahead_slots
            if not self.blocks.can_grow(seq, needed, prefix):
                break
            self._take_waiting(seq)
            self.blocks.grow(seq, needed, prefix)
            seq.status = Status.RUNNING
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def _needed(self, seq: Sequence, n: int) -> int:
        """Cache positions the sequence must own to run n more rows this step."""
        return seq.num_computed + n + self.lookahead_slots

    def _next_waiting(self, held_back: set[int]) -> Sequence | None:
        """The waiting sequence to admit next: a preempted one first; else one of the group
        that dominates the running batch; and (prefix caching) not one whose next block a
        running sequence is computing now (their seq_ids are added to `held_back`, and
        those already in it are not looked up again). None when every candidate waits so."""
        head = self.waiting[0]
        if head.num_computed or head.num_output_tokens or not self.running:
            return head  # preempted sequences go first; no preference without a batch
        groups = Counter(s.group for s in self.running if s.group is not None)
        dominant = groups.most_common(1)[0][0] if groups else None
        ready = None
        # Look a bounded way ahead so admission stays O(1)-ish per step.
        for k, seq in enumerate(self.waiting):
            if k >= 256:
                break
            if seq.seq_id in held_back:
                continue
            if self.blocks.waits_for_prefix(seq):
                held_back.add(seq.seq_id)
                continue
            if dominant is None or seq.group == dominant:
                return seq
            ready = ready or seq
        return ready

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
