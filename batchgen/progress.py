"""Progress: a rich live display on a terminal; without one, a JSON line every few seconds
on stderr. Both rewrite <run>/progress.json atomically, so another process (or a person
over ssh) can read where the run is.

A run goes through phases, each named in every line and in progress.json:

    embedding    rows through the embedding model (or found in the embedding cache)
    clustering   choosing k and fitting k-means on the sample
    assigning    every row to its nearest cluster
    generating   rows through the engine (the RunStats counters)

The first three happen only for `batching.cluster: auto` when no stored clusters exist.
"""

from __future__ import annotations

import json
import sys
import time
from collections import deque
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table

from batchgen.run_dir import write_atomic
from batchgen.stats import RunStats

# The rate of a phase is measured over its last half minute, so the ETA follows the
# current speed: rows found in the embedding cache at the start of a resumed phase
# would otherwise make the rest look many times faster than it is.
_PHASE_RATE_WINDOW_S = 30.0

# Per phase: the JSON names of (items done, items total, items per second). Fitting k-means
# gets slower as k grows, so a rate of k values would mislead: the clustering line has none.
PHASE_FIELDS = {
    "embedding": ("rows_embedded", "rows_total", "rows_s"),
    "clustering": ("k_tried", "k_candidates", None),
    "assigning": ("rows_assigned", "rows_total", "rows_s"),
}


def _fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class PhaseMeter:
    """Items done in one phase, with the rate over a recent window and an ETA."""

    def __init__(self, name: str, total: int | None, now: float | None = None) -> None:
        if name not in PHASE_FIELDS:
            raise ValueError(f"unknown progress phase {name!r} (known: {sorted(PHASE_FIELDS)})")
        self.name = name
        self.total = total
        self.done = 0
        self.started = time.monotonic() if now is None else now
        self._window: deque = deque([(self.started, 0)])  # (time, done)

    def advance_to(self, done: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.done = done
        self._window.append((now, done))
        while len(self._window) > 2 and now - self._window[1][0] > _PHASE_RATE_WINDOW_S:
            self._window.popleft()

    def rate(self) -> float | None:
        (t0, d0), (t1, d1) = self._window[0], self._window[-1]
        if t1 <= t0 or d1 <= d0:
            return None
        return (d1 - d0) / (t1 - t0)

    def eta_seconds(self) -> float | None:
        rate = self.rate()
        if rate is None or self.total is None:
            return None
        return max(self.total - self.done, 0) / rate

    def snapshot(self, now: float | None = None) -> dict:
        now = time.monotonic() if now is None else now
        done_key, total_key, rate_key = PHASE_FIELDS[self.name]
        rate, eta = self.rate(), self.eta_seconds()
        snap = {"phase": self.name, done_key: self.done, total_key: self.total}
        if rate_key is not None:
            snap[rate_key] = None if rate is None else round(rate, 1)
        snap["eta_s"] = None if eta is None else round(eta, 1)
        snap["elapsed_s"] = round(now - self.started, 1)
        return snap


class Progress:
    """Call `phase(...)` during the phases before generation and `update(stats)` during
    generation, as often as you like; it redraws at most every `interval` seconds (the
    terminal display a few times a second)."""

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
        self._meter: PhaseMeter | None = None
        self.title = ""

    def phase(self, name: str, done: int, total: int | None) -> None:
        """Report `done` of `total` items of a phase before generation. A new phase name
        starts a new meter and is always shown; so is its last item."""
        force = self._meter is None or self._meter.name != name
        if force:
            self._meter = PhaseMeter(name, total)
        self._meter.total = total
        self._meter.advance_to(done)
        self._emit(self._meter.snapshot(), force or (total is not None and done >= total))

    def start(self, stats: RunStats, title: str) -> None:
        self.title = title
        self._meter = None
        self._last = 0.0
        self.update(stats, force=True)

    def update(self, stats: RunStats, force: bool = False) -> None:
        self._emit({"phase": "generating", **stats.snapshot()}, force, stats)

    def _emit(self, snap: dict, force: bool, stats: RunStats | None = None) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        if self.progress_file is not None:
            write_atomic(self.progress_file, json.dumps(snap, indent=2), durable=False)
        if self.tty:
            renderable = self._table(stats) if stats is not None else self._phase_view()
            if self._live is None:
                console = Console(file=self.stream)
                self._live = Live(renderable, console=console, refresh_per_second=4)
                self._live.start()
            else:
                self._live.update(renderable)
        else:
            print(json.dumps({"progress": snap}), file=self.stream, flush=True)

    def finish(self, stats: RunStats) -> None:
        self.update(stats, force=True)
        self.close()

    def close(self) -> None:
        """Stop the terminal display (the last frame stays on screen)."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _phase_view(self) -> Group:
        meter = self._meter
        assert meter is not None
        snap = meter.snapshot()
        rate_key = PHASE_FIELDS[meter.name][2]
        unit = "k values" if meter.name == "clustering" else "rows"
        total = meter.total
        counts = f"{meter.done:,} / {total:,} {unit}" if total else f"{meter.done:,} {unit}"
        rate = snap.get(rate_key) if rate_key else None
        line = Table.grid(padding=(0, 2))
        line.add_row(
            f"[bold]{meter.name}[/bold]",
            ProgressBar(total=total or None, completed=meter.done, width=40),
            counts,
            "" if rate is None else f"{rate:,.1f} rows/s",
            f"elapsed {_fmt_duration(snap['elapsed_s'])}  ETA {_fmt_duration(snap['eta_s'])}",
        )
        return Group(self.title or "batchgen: clustering the prompts", line)

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
        hit = snap["prefix_cache_hit_rate"]
        table.add_row(
            "prefix cache",
            "-"
            if hit is None
            else f"{hit:.1%} of prompt tokens ({snap['cached_prompt_tokens']:,} cached)",
        )
        table.add_row(
            "elapsed / ETA", f"{_fmt_duration(snap['elapsed_s'])} / {_fmt_duration(snap['eta_s'])}"
        )
        cluster = snap["current_cluster"]
        table.add_row("cluster", "-" if cluster is None else str(cluster))
        return table
