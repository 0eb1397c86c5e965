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
- auto: embedding-based clustering is not in the planner yet; it runs as `off` and says so.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from batchgen.job_spec import BatchingSpec
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
        label = row.values.get(self.column)
        if label is None:
            return None
        label = str(label)
        if label not in self.ids:
            self.ids[label] = len(self.ids)
            self._save()
        return self.ids[label]

    def names(self) -> dict[int, str]:
        return {v: k for k, v in self.ids.items()}

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"column": self.column, "labels": self.ids}))
        os.replace(tmp, self.path)


def cluster_mode(spec: BatchingSpec) -> str:
    """ "off", "column" or "auto" (which, for now, plans as "off")."""
    if spec.cluster == "off":
        return "off"
    if spec.cluster == "auto":
        return "auto"
    return "column"


def log_cluster_mode(spec: BatchingSpec) -> None:
    if cluster_mode(spec) == "auto":
        log.info(
            "batching.cluster: auto - task clustering is not available yet; "
            "planning by prompt length only (as cluster: off)"
        )


def _window_order(row: PreparedRow) -> tuple[int, int]:
    group = -1 if row.group is None else row.group
    return (group, -row.num_prompt_tokens)


def plan_rows(rows: Iterable[PreparedRow], spec: BatchingSpec) -> Iterator[PreparedRow]:
    """Yield rows in planned order. Rows with an error are passed on at once (they never
    reach the engine); the rest are ordered inside windows of `spec.plan_window` rows."""
    window: list[PreparedRow] = []
    for row in rows:
        if row.error is not None:
            yield row
            continue
        window.append(row)
        if len(window) >= spec.plan_window:
            window.sort(key=_window_order)
            yield from window
            window = []
    window.sort(key=_window_order)
    yield from window
