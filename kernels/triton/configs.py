"""Kernel launch configs per (device, op, shape), chosen once and cached.

A run never tunes: each wrapper asks `lookup(op, key)` for a measured config from the JSON
tables in kernels/triton/configs/<op>.json (written by `batchgen bench kernels --tune` on a
GPU and committed), keyed by device name, then by a shape key such as "M16_N18432_K7168".
Missing entries fall back to the wrapper's heuristic. Tables are read once per process.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"


def device_key(device: torch.device | None = None) -> str:
    """'NVIDIA_H200' for CUDA devices, 'interpreter' otherwise."""
    if device is not None and device.type != "cuda":
        return "interpreter"
    if not torch.cuda.is_available():
        return "interpreter"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def m_bucket(m: int) -> int:
    """Token counts are bucketed to powers of two (min 1) so a table stays small."""
    b = 1
    while b < m:
        b *= 2
    return b


@functools.cache
def _table(op: str) -> dict:
    path = CONFIG_DIR / f"{op}.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object keyed by device name")
    return data


def lookup(op: str, key: str, device: torch.device | None = None) -> dict | None:
    """The tuned config for `op` at shape `key` on this device, or None."""
    entry = _table(op).get(device_key(device), {}).get(key)
    return dict(entry) if entry is not None else None
