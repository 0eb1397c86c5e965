"""Progress: a rich live display on a terminal; without one, a JSON line every few seconds
on stderr. Both rewrite <run>/progress.json atomically, so another process (or a person
over ssh) can read where the run is."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from batchgen.run_dir import write_atomic
from batchgen.stats import RunStats


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Call `update(stats)` as often as you like; it redraws at most every `interval`
    seconds (the terminal display a few times a second)."""

    def __init__(
        self,
        progress_file: Path | None,
        interval: float = 10.0,
        tty: bool | None = None,
        stream=None,
    ):
        self.progress_file = progress_file
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.interval = 0.25 if self.tty else interval
        self._last = 0.0
        self._live: Live | None = None
        self.title = ""

    def start(self, stats: RunStats, title: str) -> None:
        self.title = title
        if self.tty:
            console = Console(file=self.stream)
            self._live = Live(self._table(stats), console=console, refresh_per_second=4)
            self._live.start()
        self.update(stats, force=True)

    def update(self, stats: RunStats, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        snap = stats.snapshot()
        if self.progress_file is not None:
            write_atomic(self.progress_file, json.dumps(snap, indent=2), durable=False)
        if self._live is not None:
            self._live.update(self._table(stats))
        else:
            print(json.dumps({"progress": snap}), file=self.stream, flush=True)

    def finish(self, stats: RunStats) -> None:
        self.update(stats, force=True)
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _table(self, stats: RunStats) -> Table:
        snap = stats.snapshot()
        table = Table(title=self.title, show_header=False, box=None)
        table.add_column(style="bold")
        table.add_column()
        total = snap["rows_total"] or 1
        table.add_row(
            "rows",
            f"{snap['rows_done']:,} / {snap['rows_total']:,} ({snap['rows_done'] / total:.1%})",
        )
        table.add_row("ok / error", f"{snap['ok']:,} / {snap['error']:,}")
        table.add_row(
            "tok/s", f"prompt {snap['prompt_tok_s']:,.0f}   output {snap['output_tok_s']:,.0f}"
        )
        table.add_row(
            "elapsed / ETA", f"{_fmt_duration(snap['elapsed_s'])} / {_fmt_duration(snap['eta_s'])}"
        )
        cluster = snap["current_cluster"]
        table.add_row("cluster", "-" if cluster is None else str(cluster))
        return table
