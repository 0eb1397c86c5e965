"""A fixed-size uniform sample of a stream of vectors, independent of how it is chunked.

Each row gets a pseudo-random priority from its position in the stream (and a seed); the
sample is the `size` rows of lowest priority. Unlike a reservoir drawn with an RNG, the
result does not depend on the chunk sizes, so fitting on a stream and fitting on the same
rows in memory pick the same sample and give the same clusters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def row_priorities(start: int, count: int, seed: int) -> np.ndarray:
    """splitmix64 of (row index + seed): uniform, cheap, and a pure function of the row."""
    with np.errstate(over="ignore"):
        z = np.arange(start, start + count, dtype=np.uint64) + np.uint64(seed) * np.uint64(
            0x9E3779B97F4A7C15
        )
        z = (z + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


class StreamSample:
    """Keeps the `size` lowest-priority rows seen so far, with an optional payload per row
    (the prompt text, used later to name clusters)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        if size < 1:
            raise ValueError(f"sample size must be at least 1, got {size}")
        self.size = size
        self.seed = seed
        self.rows_seen = 0
        self._vectors: np.ndarray | None = None
        self._priority = np.zeros(0, dtype=np.uint64)
        self._index = np.zeros(0, dtype=np.int64)
        self._payload: list = []

    def add(self, vectors: np.ndarray, payload: Sequence | None = None) -> None:
        count = len(vectors)
        if count == 0:
            return
        if payload is not None and len(payload) != count:
            raise ValueError(f"{count} vectors but {len(payload)} payload items")
        priority = row_priorities(self.rows_seen, count, self.seed)
        index = np.arange(self.rows_seen, self.rows_seen + count, dtype=np.int64)
        self.rows_seen += count
        items = list(payload) if payload is not None else [None] * count
        vectors = np.asarray(vectors, dtype=np.float32)
        if self._vectors is None:
            self._vectors = np.zeros((0, vectors.shape[1]), dtype=np.float32)
        room = self.size - len(self._priority)
        if room > 0:
            # Still filling: take rows as they come, then fall through with the rest.
            self._append(vectors[:room], priority[:room], index[:room], items[:room])
            vectors, priority, index, items = (
                vectors[room:],
                priority[room:],
                index[room:],
                items[room:],
            )
        if len(priority) == 0:
            return
        # Full: only rows of priority below the current worst can enter, and each one that
        # does replaces a kept row in place (no copy of the whole sample per chunk).
        candidates = np.flatnonzero(priority < self._priority.max())
        if len(candidates) == 0:
            return
        pooled = np.concatenate([self._priority, priority[candidates]])
        keep = np.argpartition(pooled, self.size - 1)[: self.size]
        entering = keep[keep >= self.size] - self.size  # into candidates
        kept = np.zeros(len(pooled), dtype=bool)
        kept[keep] = True
        leaving = np.flatnonzero(~kept[: self.size])  # slots freed, as many as entering
        rows = candidates[entering]
        self._vectors[leaving] = vectors[rows]
        self._priority[leaving] = priority[rows]
        self._index[leaving] = index[rows]
        for slot, row in zip(leaving, rows):
            self._payload[slot] = items[row]

    def _append(self, vectors, priority, index, items) -> None:
        self._vectors = np.concatenate([self._vectors, vectors])
        self._priority = np.concatenate([self._priority, priority])
        self._index = np.concatenate([self._index, index])
        self._payload.extend(items)

    def result(self) -> tuple[np.ndarray, list]:
        """(vectors (m, dim), payloads) ordered by stream position, m = min(size, rows seen)."""
        if self._vectors is None:
            raise ValueError("the sample is empty: no rows were added")
        order = np.argsort(self._index, kind="stable")
        return self._vectors[order], [self._payload[i] for i in order]
