"""The order rows go to the engine, and the group id each carries (Request.group).

`plan_rows` is the seam: an iterator of prepared rows and the batching spec in, the same rows
out in planned order with `group` set. Memory is bounded by `batching.plan_window` rows.

Modes:
- off: rows are sorted by prompt length inside each window of `plan_window` rows, longest
  first, so a running batch holds prompts of similar length and long ones do not trail at
  the end. No group.
- a column of task labels: each label is a group; inside a window rows are ordered by
  group, then length. The label -> id map is kept in the run directory so a resumed run
  gives the same ids.
- auto: each row's group is its task cluster (batchgen.task_clusters, set by the run loop).

With `batching.prefix_caching` (the default), inside each group of a window the rows that
share a prompt prefix go together, longest shared prefix first, before the rows that share
nothing (longest first): batchgen/prefix_order.py.

Given a spill directory, a job with groups (auto or a column) is planned cluster by
cluster instead: rows are spilled to one bucket file per group, and once the input is read
the buckets are fed largest first, each in windows of `plan_window` rows sorted by length.
A running batch then holds one task for as long as its cluster lasts, and memory stays
bounded by the window whatever the input size. When the first group is known before the
input is read (auto: the largest cluster), its rows are not spilled but fed as their
windows fill, so generation starts while the rest of the input is still being read,
rendered and spilled into the other buckets.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import groupby
from pathlib import Path

from batchgen.job_spec import BatchingSpec
from batchgen.prefix_order import shared_prefix_order
from batchgen.rows import InputRow, PreparedRow

log = logging.getLogger(__name__)


class ClusterLabels:
    """Stable small integer ids for the task labels of a `cluster: <column>` job."""

    def __init__(self, column: str, path: Path | None = None):
        self.column = column
        self.path = path
        self.ids: dict[str, int] = {}
        if path is not None and path.exists():
            self.ids = json.loads(path.read_text())["labels"]

    def assign(self, row: InputRow) -> int | None:
        return self.id_for(row.values.get(self.column))

    def id_for(self, label) -> int | None:
        if label is None:
            return None
        label = str(label)
        if label not in self.ids:
            self.ids[label] = len(self.ids)
            self._save()
        return self.ids[label]

    def names(self) -> dict[int, str]:
        return {v: k for k, v in self.ids.items()}

    def largest_group(self) -> int | None:
        """Labels get ids as they are first seen: no size is known before the input is
        read, so no group can be fed before the others."""
        return None

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"column": self.column, "labels": self.ids}))
        tmp.replace(self.path)


def cluster_mode(spec: BatchingSpec) -> str:
    """ "off", "column" or "auto"."""
    if spec.cluster == "off":
        return "off"
    if spec.cluster == "auto":
        return "auto"
    return "column"


def log_cluster_mode(spec: BatchingSpec) -> None:
    if cluster_mode(spec) == "auto":
        log.info("batching.cluster: auto - prompts are embedded and clustered by task type")


def _window_order(row: PreparedRow) -> tuple[int, int]:
    group = -1 if row.group is None else row.group
    return (group, -row.num_prompt_tokens)


def _ordered(window: list[PreparedRow], spec: BatchingSpec) -> list[PreparedRow]:
    """A window's rows by group, each group longest prompt first, or with prefix caching
    its rows sharing a prompt prefix together (batchgen/prefix_order.py)."""
    window.sort(key=_window_order)
    if not spec.prefix_caching:
        return window
    return [
        row
        for _, rows in groupby(window, key=lambda r: r.group)
        for row in shared_prefix_order(list(rows))
    ]


def plan_rows(
    rows: Iterable[PreparedRow],
    spec: BatchingSpec,
    spill_dir: Path | None = None,
    first_group: int | None = None,
) -> Iterator[PreparedRow]:
    """Yield rows in planned order. Rows with an error are passed on at once (they never
    reach the engine); the rest are ordered inside windows of `spec.plan_window` rows, or,
    with a spill_dir and a clustered mode, cluster by cluster, `first_group` (if given)
    first and fed while the input is read (see the module doc)."""
    if spill_dir is not None and cluster_mode(spec) != "off":
        yield from plan_by_cluster(rows, spec, spill_dir, first_group)
        return
    window: list[PreparedRow] = []
    for row in rows:
        if row.error is not None:
            yield row
            continue
        window.append(row)
        if len(window) >= spec.plan_window:
            yield from _ordered(window, spec)
            window = []
    yield from _ordered(window, spec)


class ClusterBuckets:
    """One append-only spill file per group in `directory`, holding pickled batches of
    PreparedRows. The files belong to one session: a new session starts them afresh."""

    _FLUSH_ROWS = 256

    def __init__(self, directory: Path):
        self.directory = directory
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        self.sizes: Counter = Counter()
        self._pending: dict[int | None, list[PreparedRow]] = {}

    def _path(self, group: int | None) -> Path:
        return self.directory / f"group-{'none' if group is None else group}.pkl"

    def add(self, row: PreparedRow) -> None:
        self.sizes[row.group] += 1
        pending = self._pending.setdefault(row.group, [])
        pending.append(row)
        if len(pending) >= self._FLUSH_ROWS:
            self._flush(row.group)

    def _flush(self, group: int | None) -> None:
        with open(self._path(group), "ab") as f:
            pickle.dump(self._pending.pop(group), f, protocol=pickle.HIGHEST_PROTOCOL)

    def drain(self, spec: BatchingSpec) -> Iterator[PreparedRow]:
        """Every group, largest first (rows without a group last), in windows of
        `spec.plan_window` rows ordered as plan_rows orders a window; each file is deleted
        once read."""
        window_rows = spec.plan_window
        for group in list(self._pending):
            self._flush(group)
        order = sorted(self.sizes, key=lambda g: (g is None, -self.sizes[g], g or 0))
        for group in order:
            path = self._path(group)
            window: list[PreparedRow] = []
            with open(path, "rb") as f:
                while True:
                    try:
                        window.extend(pickle.load(f))
                    except EOFError:
                        break
                    while len(window) >= window_rows:
                        head, window = window[:window_rows], window[window_rows:]
                        yield from _ordered(head, spec)
            yield from _ordered(window, spec)
            path.unlink()
        shutil.rmtree(self.directory, ignore_errors=True)


def plan_by_cluster(
    rows: Iterable[PreparedRow],
    spec: BatchingSpec,
    spill_dir: Path,
    first_group: int | None = None,
) -> Iterator[PreparedRow]:
    """Cluster-by-cluster order: spill every row to its group's bucket, then drain. Rows of
    `first_group` skip the spill: each window of them goes out as soon as it is full, in
    the order the drain would have given them."""
    buckets = ClusterBuckets(spill_dir)
    window: list[PreparedRow] = []
    for row in rows:
        if row.error is not None:
            yield row
        elif first_group is not None and row.group == first_group:
            window.append(row)
            if len(window) >= spec.plan_window:
                yield from _ordered(window, spec)
                window = []
        else:
            buckets.add(row)
    yield from _ordered(window, spec)
    yield from buckets.drain(spec)
