"""The record of a run's engine faults: <run>/engine_faults.jsonl, one JSON line per event,
appended by every session, so the report (and `batchgen report`) counts restarts from the
run directory alone.

Events: "step_failed" (the engine raised during a step), "row_failed_alone" (a suspect
row failed with nothing else in flight and became an error row), "build_failed" (building
the engine raised), "restart" (a new engine was built after a fault) and "gave_up" (too
many failures in a row: the session stopped, resumable).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from batchgen.store_path import StorePath, run_path

FILE_NAME = "engine_faults.jsonl"


class EngineFaultLog:
    def __init__(self, run: str | Path | StorePath, session: str | None = None) -> None:
        self.path = run_path(run) / FILE_NAME
        self.session = session

    def append(self, event: str, **fields) -> None:
        record = {"event": event, "time": time.time(), "session": self.session, **fields}
        # Not fsynced: it is a diagnostic record; the results never depend on it.
        with self.path.open("a") as f:
            f.write(json.dumps(record, default=str) + "\n")

    def events(self) -> list[dict]:
        """Every event in order; a torn last line (a crash while appending) is skipped."""
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


def summarize(events: list[dict]) -> dict:
    """report.json's view: the restart count and each fault in a few fields."""
    faults = [e for e in events if e.get("event") != "restart"]
    return {
        "engine_restarts": sum(1 for e in events if e.get("event") == "restart"),
        "engine_faults": [
            {k: e.get(k) for k in ("time", "session", "event", "error", "id", "max_num_seqs")}
            for e in faults
        ],
    }
