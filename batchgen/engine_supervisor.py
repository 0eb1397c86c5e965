"""The run's engine, and its rebuild after a fault.

`EngineSupervisor.stream` runs `llm.stream` and turns an exception raised by the engine
(CUDA out of memory, a kernel's RuntimeError, a dead worker) into `EngineFailure`, which
carries only a plain `EngineFault` record; an exception raised by the caller's own
request iterator passes unchanged. `restart` frees the failed engine and builds a new one
(after running out of memory with half the max_num_seqs, at least 1).

A failure streak counts engine failures (a step raising, or a build raising) since the
engine last finished a request ok; every failure after the first is a failed rebuild (the
rebuild raised, or the rebuilt engine raised before finishing a request). A row that fails
alone, on an engine that finished a request ok since its last failure, does not count:
that failure is the row's, not the engine's. `probe` (a one-token request) tells the two
apart when nothing else has run since. After MAX_FAILED_REBUILDS failed rebuilds in a row,
`EngineGaveUp` stops the session (exit 5: committed rows stay, a rerun resumes).
"""

from __future__ import annotations

import gc
import logging
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from batchgen.engine_faults import EngineFaultLog

log = logging.getLogger(__name__)

MAX_FAILED_REBUILDS = 3


@dataclass(frozen=True)
class EngineFault:
    """What is kept of an engine exception. Not the exception itself: its traceback holds
    the failed engine's frames, and so its memory, for as long as it lives."""

    error: str  # "RuntimeError: ..." on one line
    out_of_memory: bool
    in_step: frozenset[str] | None  # request ids of the failing step; None: unknown
    traceback: str


class EngineFailure(Exception):
    def __init__(self, fault: EngineFault) -> None:
        super().__init__(fault.error)
        self.fault = fault


class EngineGaveUp(Exception):
    """Too many engine failures in a row; the message says why, on one line."""


def is_out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, MemoryError)


def describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())  # CUDA messages span lines
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def free_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def engine_max_num_seqs(llm) -> int | None:
    config = getattr(llm, "config", None)
    return getattr(config, "max_num_seqs", None) or getattr(llm, "max_num_seqs", None)


class EngineSupervisor:
    """Holds the one reference to the run's engine (`llm`), so that dropping it frees it.

    `build(max_num_seqs)` makes a new engine; `retire(llm)` is called with the old one
    before it is dropped (to save what it recorded)."""

    def __init__(
        self,
        llm,
        build: Callable[[int | None], object],
        retire: Callable[[object], None],
        faults: EngineFaultLog,
    ) -> None:
        self.llm = llm
        self._build = build
        self._retire = retire
        self.faults = faults
        self.max_num_seqs = engine_max_num_seqs(llm)
        self.streak = 0
        self.restarts = 0

    def stream(self, requests: Iterable) -> Iterator:
        """`llm.stream(requests)`, with the engine's exceptions raised as EngineFailure."""
        source = _Watched(requests)
        outputs = self.llm.stream(source)
        while True:
            try:
                out = next(outputs)
            except StopIteration:
                return
            except Exception as exc:
                if exc is source.raised:
                    raise
                fault = EngineFault(
                    describe(exc),
                    is_out_of_memory(exc),
                    getattr(self.llm, "requests_in_step", None),
                    "".join(traceback.format_exception(exc)),
                )
            else:
                yield out
                continue
            # Raised outside the except clause, so the EngineFailure has no __context__
            # chaining it to the engine's exception and frames.
            raise EngineFailure(fault)

    def row_ok(self) -> None:
        self.streak = 0

    def probe(self, prompt_token_ids: list[int]) -> bool:
        """Whether the engine finishes a one-token request (the first token of a row's
        prompt, with nothing else in flight). A failed probe counts in the streak and the
        engine is rebuilt (EngineGaveUp at the limit)."""
        from engine import Request, SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1)
        request = Request("probe", list(prompt_token_ids[:1]), params)
        try:
            for _ in self.stream([request]):
                pass
        except EngineFailure as failure:
            fault = failure.fault
        else:
            self.row_ok()
            return True
        log.warning("the engine failed a one-token probe: %s", fault.error)
        self.faults.append("probe_failed", error=fault.error, traceback=fault.traceback)
        self.count_failure(fault.error)
        self.restart(fault, shrink=False)
        return False

    def count_failure(self, error: str) -> None:
        """One more failure in the streak; EngineGaveUp once the failures after the first
        (failed rebuilds) reach MAX_FAILED_REBUILDS."""
        self.streak += 1
        failed_rebuilds = self.streak - 1
        if failed_rebuilds >= MAX_FAILED_REBUILDS:
            message = (
                f"the engine failed and {failed_rebuilds} rebuilds in a row failed too, "
                f"without finishing a row (last: {error})"
            )
            self.faults.append("gave_up", error=error, failures_in_a_row=self.streak)
            raise EngineGaveUp(message)

    def restart(self, fault: EngineFault, shrink: bool = True) -> None:
        """Drop the failed engine, free its memory, and build a new one; a build that
        raises counts in the streak and is tried again (EngineGaveUp at the limit)."""
        old, self.llm = self.llm, None
        if old is not None:
            self._retire(old)
        del old
        free_memory()
        if fault.out_of_memory and shrink and self.max_num_seqs is not None:
            smaller = max(1, self.max_num_seqs // 2)
            if smaller < self.max_num_seqs:
                log.warning(
                    "engine out of memory: rebuilding it with max_num_seqs %d (was %d)",
                    smaller,
                    self.max_num_seqs,
                )
            else:
                log.warning("engine out of memory with max_num_seqs 1: rebuilding it as it was")
            self.max_num_seqs = smaller
        while True:
            try:
                self.llm = self._build(self.max_num_seqs)
                break
            except Exception as exc:
                error = describe(exc)
                del exc
                log.warning("rebuilding the engine failed: %s", error)
                self.faults.append("build_failed", error=error)
                free_memory()
                self.count_failure(error)
        self.restarts += 1
        self.faults.append("restart", max_num_seqs=self.max_num_seqs)
        log.info("engine rebuilt (restart %d of this session)", self.restarts)


class _Watched:
    """An iterator over `requests` that remembers what it raised, so that an exception
    from the caller's side (planner, renderer, writer) is told apart from the engine's."""

    def __init__(self, requests: Iterable) -> None:
        self._it = iter(requests)
        self.raised: BaseException | None = None

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._it)
        except StopIteration:
            raise
        except BaseException as exc:
            self.raised = exc
            raise
