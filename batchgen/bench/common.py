"""What every benchmark records: the machine, the command, and where the JSON goes."""

from __future__ import annotations

import json
import os
import platform
import sys
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
