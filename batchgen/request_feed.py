"""The input side of the engine, kept across engine restarts.

The engine pulls requests from `RequestFeed.requests()`, a generator that first yields
what is queued and then rows from the planner. When the engine fails, the stream over that
generator is dead, but the feed is not: `requeue_after_failure` puts the requests of every
row still in flight back in the queue (same request ids, same seeds), ahead of rows the
planner has not yet given, and a fresh `requests()` generator continues the same planner
iterator. Rows leave the feed's `pending` map only when all their completions are in.

Poison rows: a row in the failing step of two engine failures is a suspect. It is set
aside (not requeued) and run alone later by the run loop (`next_suspect`, `run_alone`);
the feed stops yielding (`pause`) so the engine can drain first.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from batchgen.job_spec import JobSpec
from batchgen.row_sampling import RowSampling
from batchgen.rows import PreparedRow, ResultRow

# A row in the failing step of this many engine failures is retried alone.
SUSPECT_AFTER_FAILURES = 2


def derive_seed(job_seed: int, row_id: str, n_index: int) -> int:
    """The seed of one completion: a function of (job seed, row id, n_index) only, so a
    row's sample does not depend on its batch, its cluster or its position."""
    digest = hashlib.blake2b(f"{job_seed}\0{row_id}\0{n_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sampling_params(job: JobSpec, seed: int, row: PreparedRow | None = None):
    """The engine parameters of one completion: the row's own when it has them, else the
    job's."""
    sampling = row.sampling if row is not None and row.sampling is not None else None
    return (sampling or RowSampling.from_job(job.sampling)).engine_params(seed)


def request_id(seq: int, n_index: int) -> str:
    return f"{seq}:{n_index}"


def parse_request_id(rid: str) -> tuple[int, int]:
    """(row seq, n_index) of a request id made by `request_id`."""
    seq, k = rid.split(":")
    return int(seq), int(k)


@dataclass
class PendingRow:
    """A row given to the engine whose completions are not all in."""

    row: PreparedRow
    seeds: list[int]  # one per n_index, derived once: a requeued request keeps its seed
    results: dict[int, ResultRow] = field(default_factory=dict)
    failures: int = 0  # engine failures whose failing step held this row


class RequestFeed:
    """Rows from the planner in, engine requests out; survives engine restarts.

    `on_error_row(row)` receives planner rows that cannot run (they never reach the
    engine); `should_stop()` is asked before each new row (Ctrl-C, error budget)."""

    def __init__(
        self,
        job: JobSpec,
        planned: Iterable[PreparedRow],
        on_error_row: Callable[[PreparedRow], None],
        should_stop: Callable[[], bool],
    ) -> None:
        self.job = job
        self.n = job.sampling.n
        self._rows = iter(planned)
        self._on_error_row = on_error_row
        self._should_stop = should_stop
        self.pending: dict[int, PendingRow] = {}  # by row seq, in the order first fed
        self._queue: deque = deque()  # requests of pending rows, to yield before new rows
        self.suspects: dict[int, PendingRow] = {}  # set aside, to run alone
        self.exhausted = False  # the planner has given its last row
        self.paused = False

    # -- the generator the engine pulls from ------------------------------------------
    def requests(self) -> Iterator:
        """A fresh generator over the queue, then the planner. Ends when the planner is
        done, on pause, or when should_stop() says so (the engine then drains)."""
        self.paused = False
        while not self.paused and not self._should_stop():
            if self._queue:
                yield self._queue.popleft()
                continue
            if self.exhausted:
                return
            row = next(self._rows, None)
            if row is None:
                self.exhausted = True
                return
            if row.error is not None:
                self._on_error_row(row)
                continue
            # A row's explicit seed takes the job seed's place for that row.
            base = self.job.sampling.seed if row.sampling is None else row.sampling.seed
            n = row.num_completions(self.n)
            seeds = [derive_seed(base, row.id, k) for k in range(n)]
            pending = self.pending[row.seq] = PendingRow(row, seeds)
            self._queue.extend(self.requests_of(pending))

    def pause(self) -> None:
        """Stop yielding at the next pull; the queue and planner position are kept."""
        self.paused = True

    def requests_of(self, pending: PendingRow) -> list:
        """The requests of the completions of `pending` not yet in."""
        from engine import Request

        row = pending.row
        return [
            Request(
                request_id=request_id(row.seq, k),
                prompt=row.prompt_token_ids,
                sampling_params=sampling_params(self.job, seed, row),
                group=row.group,
                tag=row.id,
            )
            for k, seed in enumerate(pending.seeds)
            if k not in pending.results
        ]

    # -- results --------------------------------------------------------------------
    def complete(self, rid: str, result: ResultRow) -> list[ResultRow] | None:
        """Record one completion; returns the row's results (n_index order) when it was the
        last one, and the row leaves the feed."""
        seq, k = parse_request_id(rid)
        pending = self.pending[seq]
        pending.results[k] = result
        if len(pending.results) < len(pending.seeds):
            return None
        del self.pending[seq]
        self.suspects.pop(seq, None)
        return [pending.results[i] for i in range(len(pending.seeds))]

    def pending_row(self, rid: str) -> PendingRow:
        return self.pending[parse_request_id(rid)[0]]

    @property
    def done(self) -> bool:
        """Every row the planner gave has finished."""
        return self.exhausted and not self.pending

    # -- engine failures --------------------------------------------------------------
    def requeue_after_failure(self, in_step: frozenset[str] | None) -> list[PendingRow]:
        """After an engine failure: count it against the rows of the failing step
        (`in_step` request ids; None when unknown: every pending row), set aside the rows
        that reached SUSPECT_AFTER_FAILURES, and queue the other pending rows' requests
        again in the order they were first fed. Returns the new suspects."""
        failed_seqs = None if in_step is None else {parse_request_id(r)[0] for r in in_step}
        new_suspects = []
        self._queue.clear()
        for seq, pending in self.pending.items():
            if seq in self.suspects:
                continue
            if failed_seqs is None or seq in failed_seqs:
                pending.failures += 1
            if pending.failures >= SUSPECT_AFTER_FAILURES:
                self.suspects[seq] = pending
                new_suspects.append(pending)
                continue
            self._queue.extend(self.requests_of(pending))
        return new_suspects

    def next_suspect(self) -> PendingRow | None:
        """The suspect to run alone next, oldest first."""
        return next(iter(self.suspects.values()), None)

    def run_alone(self, pending: PendingRow) -> list:
        """Take `pending` off the suspects (it stays pending until its results are in)
        and return its requests, to be run with nothing else in flight."""
        self.suspects.pop(pending.row.seq, None)
        return self.requests_of(pending)

    def drop(self, pending: PendingRow) -> None:
        """Forget a row that finished outside the engine's results (an engine_error row)."""
        self.pending.pop(pending.row.seq, None)
        self.suspects.pop(pending.row.seq, None)
