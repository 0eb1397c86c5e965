"""Host work inside a CUDA stream (and so inside a captured CUDA graph): `launch_host_func`
enqueues a Python callable that the driver runs on its own thread once the stream's
earlier work is done, and the stream's later work waits for it (cuLaunchHostFunc; under
stream capture it becomes a graph host node, replayed with the graph).

The callable must not call CUDA (the driver forbids it in host functions): it works on
pinned host buffers that copies on the same stream fill before it and read after it.
An exception inside it cannot propagate through the driver: it is kept, and the next
`raise_host_failures` (the decode graph runner calls it when it reads a step's tokens)
raises it, so a failed step is never taken for a good one.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

_HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_driver = None
_failures: list[BaseException] = []


def _cuda_driver():
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
        _driver.cuLaunchHostFunc.argtypes = [ctypes.c_void_p, _HOST_FN, ctypes.c_void_p]
        _driver.cuLaunchHostFunc.restype = ctypes.c_int
    return _driver


class HostFunc:
    """A callable wrapped for the driver. Keep the object alive as long as any stream or
    graph may still run it (a graph: as long as the graph)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.c_callback = _HOST_FN(self._run)

    def _run(self, _user_data) -> None:
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - nothing can be raised to the driver
            log.exception("host function failed inside a CUDA stream")
            _failures.append(exc)

    def launch(self, stream: torch.cuda.Stream | None = None) -> None:
        stream = stream or torch.cuda.current_stream()
        rc = _cuda_driver().cuLaunchHostFunc(
            ctypes.c_void_p(stream.cuda_stream), self.c_callback, None
        )
        if rc != 0:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUDA driver error {rc}")


def raise_host_failures() -> None:
    """Raise the first exception a host function hit since the last call (then clear)."""
    if _failures:
        first = _failures[0]
        _failures.clear()
        raise RuntimeError(f"host work inside a CUDA graph failed: {first!r}") from first
