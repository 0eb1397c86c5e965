"""What every benchmark records (the machine, the command, where the JSON goes), and the
peak-RSS sampler the memory benchmarks share."""

from __future__ import annotations

import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import torch

BENCH_DIR = Path(os.environ.get("BATCHGEN_BENCH_DIR", "data/benchmarks"))


def machine_info() -> dict:
    info = {
        "hostname": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _command_line() -> str:
    """The command as typed: `batchgen bench ...`, or `python -m batchgen.bench.<module>
    ...` when a benchmark module ran directly (as on the GPU machine, with no install)."""
    if not sys.argv:
        return ""
    args = " ".join(sys.argv[1:])
    script = Path(sys.argv[0])
    if script.suffix == ".py" and script.parent.name == "bench":
        return f"python -m batchgen.bench.{script.stem} {args}".rstrip()
    return f"batchgen {args}".rstrip()


def write_result(name: str, payload: dict) -> Path:
    """Write data/benchmarks/<name>.json with machine, command and time stamped in."""
    BENCH_DIR.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": machine_info(),
        "command": _command_line(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **payload,
    }
    path = BENCH_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def _rss_anon() -> int:
    """Anonymous resident bytes (Linux /proc): RSS without file-backed pages (a
    memory-mapped cache, shared libraries), which the kernel can drop at any time."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakRss:
    """Samples this process's resident set size on a thread while entered: `peak` (all of
    RSS) and `peak_anon` (RSS less file-backed pages), in bytes, with `start_rss` and
    `start_anon` as they were at construction."""

    def __init__(self, interval_s: float = 0.05):
        import psutil

        self._process = psutil.Process()
        self.interval_s = interval_s
        self.start_rss = self._process.memory_info().rss
        self.start_anon = _rss_anon()
        self.peak = self.start_rss
        self.peak_anon = self.start_anon
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.peak = max(self.peak, self._process.memory_info().rss)
        self.peak_anon = max(self.peak_anon, _rss_anon())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
