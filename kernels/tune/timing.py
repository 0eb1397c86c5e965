"""Timing on a CUDA GPU, as the engine runs kernels: launches replayed from CUDA graphs, so
host launch cost is left out and per-launch gaps on the device are counted."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch


def median_ms(fn: Callable[[], object], warmup_ms: int = 25, rep_ms: int = 150) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def cycle(calls: list) -> Callable[[], object]:
    """One callable that runs `calls` in turn, one per invocation."""
    it = itertools.cycle(calls)
    return lambda: next(it)()


def graphed(calls: list) -> Callable[[], None]:
    """Capture each call in its own CUDA graph and return a callable that replays them in
    turn."""
    for call in calls:  # compile and warm up outside capture
        call()
    torch.cuda.synchronize()
    graphs = []
    for call in calls:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
        graphs.append(g)
    it = itertools.cycle(graphs)
    return lambda: next(it).replay()


def time_graphed(calls: list) -> float:
    """Median ms per call replayed from CUDA graphs; eager if capture fails (reported)."""
    try:
        return median_ms(graphed(calls))
    except RuntimeError as err:
        print(f"  graph capture failed ({err}); timing eagerly")
        return median_ms(cycle(calls))


def time_chain(calls: list, warmup_ms: int = 25, rep_ms: int = 150) -> float:
    """Median ms per call of `calls` captured back to back in one CUDA graph (each on its
    own inputs, e.g. weight copies that together exceed the L2, as a decode step's layers
    read theirs from HBM)."""
    for call in calls:  # compile and allocate outside capture
        call()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for call in calls:
            call()
    return median_ms(g.replay, warmup_ms=warmup_ms, rep_ms=rep_ms) / len(calls)


def copy_bandwidth(device: torch.device, gib: float = 2.0) -> float:
    """Device-to-device copy in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3)


def fastest(time_cfg: Callable[[dict], float], candidates: list[dict]) -> dict:
    """The candidate with the least time_cfg(cfg) ms; a config that fails to compile or
    launch (registers, shared memory) is skipped. The first candidate when all fail."""
    best, best_ms = candidates[0], float("inf")
    for cfg in candidates:
        try:
            ms = time_cfg(cfg)
        except Exception as err:  # a config can exceed shared memory or registers
            print(f"  skip {cfg}: {type(err).__name__}")
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best
