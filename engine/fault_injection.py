"""Faults injected into the engine's steps on purpose, to test the paths that survive them.

The environment variable BATCHGEN_FAULT_INJECT holds comma-separated faults:

    oom@step=N      raise torch.OutOfMemoryError at the engine's N-th step, once
    crash@step=N    raise RuntimeError at the engine's N-th step, once
    crash@step=every   raise RuntimeError at every step (an engine that never works)
    crash@row=ID    raise RuntimeError at every step that holds the request tagged ID
    oom@row=ID      the same with torch.OutOfMemoryError

A fault fires from inside `LLMEngine.step`, just before the model runs the step's batch:
where a real CUDA out-of-memory or kernel error surfaces, so the caller handles it as
it would a real one. A step fault fires once per process: an engine rebuilt after it
counts its steps from 1 again and must not meet the same fault a second time.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

ENV_VAR = "BATCHGEN_FAULT_INJECT"
_KINDS = ("oom", "crash")
_TRIGGERS = ("step", "row")
EVERY = "every"


class FaultSpecError(ValueError):
    """BATCHGEN_FAULT_INJECT does not parse; the message names the bad entry."""


@dataclass(frozen=True)
class Fault:
    kind: str  # "oom" | "crash"
    trigger: str  # "step" | "row"
    value: int | str  # step number, EVERY, or a request tag (row id)

    @property
    def spec(self) -> str:
        return f"{self.kind}@{self.trigger}={self.value}"


def parse_faults(spec: str) -> list[Fault]:
    """The faults of a BATCHGEN_FAULT_INJECT value; FaultSpecError names a malformed one."""
    faults = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        kind, at, rest = entry.partition("@")
        trigger, eq, value = rest.partition("=")
        if not at or not eq or kind not in _KINDS or trigger not in _TRIGGERS or not value:
            raise FaultSpecError(
                f"{ENV_VAR}: cannot parse {entry!r}; expected oom@step=N, crash@step=N, "
                "crash@step=every or crash@row=ID (comma-separated)"
            )
        if trigger == "step" and value != EVERY:
            if not value.isdigit() or int(value) < 1:
                raise FaultSpecError(
                    f"{ENV_VAR}: {entry!r}: the step must be a whole number >= 1 or 'every'"
                )
            value = int(value)
        faults.append(Fault(kind, trigger, value))
    return faults


class FaultInjector:
    """Raises the configured faults at the steps they name."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = faults
        self._fired: set[Fault] = set()

    def before_step(self, step: int, tags: Collection[str]) -> None:
        """Called with the engine's step number (from 1) and the tags of the requests in
        the step, just before the step runs."""
        for fault in self.faults:
            if fault.trigger == "row":
                if fault.value in tags:
                    _raise(fault, f"step {step} holds row {fault.value}")
            elif fault.value == EVERY:
                _raise(fault, f"step {step}")
            elif fault.value == step and fault not in self._fired:
                self._fired.add(fault)
                _raise(fault, f"step {step}")


def _raise(fault: Fault, where: str) -> None:
    message = f"injected fault {fault.spec} ({ENV_VAR}) at {where}"
    if fault.kind == "oom":
        # Imported here so that checking a spec (batchgen does, before any model is
        # loaded) does not import torch.
        import torch

        raise torch.OutOfMemoryError(f"CUDA out of memory: {message}")
    raise RuntimeError(message)


# One injector per spec for the whole process, not per engine: "once" is once in the run,
# so the engine built after a fault does not fire it again at its own step N.
_process_injectors: dict[str, FaultInjector] = {}


def from_environment() -> FaultInjector | None:
    """The process's injector for BATCHGEN_FAULT_INJECT, or None when it is unset or
    empty. Raises FaultSpecError for a malformed value."""
    spec = os.environ.get(ENV_VAR, "").strip()
    if not spec:
        return None
    injector = _process_injectors.get(spec)
    if injector is None:
        injector = _process_injectors[spec] = FaultInjector(parse_faults(spec))
    return injector
