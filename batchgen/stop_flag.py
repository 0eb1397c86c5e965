"""SIGINT (Ctrl-C) and SIGTERM (what a scheduler, systemd or `docker stop` sends) during a
run.

While rows are being generated, the first signal asks the loop to stop feeding rows and to
finish the ones in flight; the part is then written and the run exits 5, resumable. The
finishing is bounded: after the grace period (BATCHGEN_STOP_GRACE_S, default 30 s) or at a
second signal, the loop stops stepping the engine at once; what finished is written and the
rows still in flight run again on resume. Outside generation (loading, checking, writing
the report) a signal stops at once: there is nothing in flight to finish.
"""

from __future__ import annotations

import _thread
import logging
import os
import signal
import threading
from contextlib import contextmanager

from batchgen.job_spec import JobError

log = logging.getLogger(__name__)

GRACE_ENV = "BATCHGEN_STOP_GRACE_S"
DEFAULT_GRACE_S = 30.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)


def grace_seconds() -> float:
    raw = os.environ.get(GRACE_ENV)
    if raw is None:
        return DEFAULT_GRACE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise JobError(f"{GRACE_ENV}: '{raw}' is not a number of seconds >= 0")
    return value


class StopFlag:
    """`with flag.installed(graceful=True):` around the generation loop; the loop checks
    `requested` before feeding each row. A stop that must not wait raises
    KeyboardInterrupt in the main thread, which the loop treats as "stop now"."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.grace_s = grace_seconds() if grace_s is None else grace_s
        self.requested = False
        self.signal_name: str | None = None
        self._graceful = False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self._graceful or self.requested:
            if self._graceful and self._timer is not None:  # a second signal in the grace
                log.warning("%s again: stopping now; the rows in flight run again on resume", name)
            self.requested = True
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = name
        log.warning(
            "%s: finishing the rows in flight (at most %.0f s; a second signal stops at "
            "once), then writing the last part",
            name,
            self.grace_s,
        )
        with self._lock:
            self._timer = threading.Timer(self.grace_s, self._grace_over)
            self._timer.daemon = True
            self._timer.start()

    def _grace_over(self) -> None:
        with self._lock:
            if self._timer is None:  # the loop ended first
                return
            self._timer = None
        log.warning(
            "grace period over: writing the rows that finished; the rows still in flight "
            "run again on resume"
        )
        # Runs the handler in the main thread, which then raises KeyboardInterrupt there.
        _thread.interrupt_main(signal.SIGINT)

    @contextmanager
    def installed(self, graceful: bool):
        """Handle SIGINT and SIGTERM for the duration (main thread only: elsewhere
        signals cannot be handled, and the caller's own handling stays)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self.handler) for s in SIGNALS}
        was_graceful, self._graceful = self._graceful, graceful
        try:
            yield self
        finally:
            with self._lock:
                if self._timer is not None:
                    self._timer.cancel()
                    self._timer = None
            self._graceful = was_graceful
            for s, handler in previous.items():
                signal.signal(s, handler)
