"""Kernel launch configs per (device, op, shape), chosen once and cached.

A run never tunes: each wrapper asks `lookup(op, key)` for a measured config from the JSON
tables in kernels/triton/configs/<op>.json (written by the tuner, kernels/tune/, on a GPU
through `write_entries`, and committed), keyed by device name, then by a shape key such as
"M16_N18432_K7168". Missing entries fall back to the wrapper's heuristic. Tables are read
once per process; `store` puts a config in front of the table for this process only (the
in-step tuner tries its candidates that way).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"

# op -> device key -> shape key -> config, set by `store`; consulted before the tables
_stored: dict[str, dict[str, dict[str, dict]]] = {}


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


def _read(path: Path) -> dict:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object keyed by device name")
    return data


@functools.cache
def _table(op: str) -> dict:
    return _read(CONFIG_DIR / f"{op}.json")


def lookup(op: str, key: str, device: torch.device | None = None) -> dict | None:
    """The config for `op` at shape `key` on this device (stored, else tuned), or None."""
    dev = device_key(device)
    entry = _stored.get(op, {}).get(dev, {}).get(key)
    if entry is None:
        entry = _table(op).get(dev, {}).get(key)
    return dict(entry) if entry is not None else None


def store(op: str, key: str, config: dict, device: torch.device | None = None) -> None:
    """From now on this process's lookups of (op, key) on `device` return `config`; the
    table files are untouched. Kernels read configs when they launch, so a CUDA graph
    captured before keeps the config it was captured with."""
    _stored.setdefault(op, {}).setdefault(device_key(device), {})[key] = dict(config)


def clear_stored(op: str | None = None) -> None:
    """Forget what `store` set for `op` (every op when None): lookups see the tables again."""
    if op is None:
        _stored.clear()
    else:
        _stored.pop(op, None)


# The keys a row-count tile entry may set: a batch-invariant kernel's row bits do not depend
# on them (BLOCK_K, the K split and the operand orientation stay the shape's).
TILE_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"})


def with_row_tiles(cfg: dict, m: int) -> dict:
    """`cfg` for an M-row call. A fixed (batch-invariant) entry may carry "TILES": row count
    -> tiles measured at that count; a call takes those of the smallest count >= M, and
    the entry's own tiles above the largest. The "TILES" key itself is dropped."""
    tiles = cfg.get("TILES")
    if tiles is None:
        return cfg
    out = {key: value for key, value in cfg.items() if key != "TILES"}
    fits = [int(rows) for rows in tiles if int(rows) >= m]
    if fits:
        chosen = tiles[str(min(fits))]
        assert set(chosen) <= TILE_KEYS, f"row tiles may set only {sorted(TILE_KEYS)}: {chosen}"
        out.update(chosen)
    return out


def write_entries(op: str, device: str, entries: dict[str, dict], out_dir: Path) -> Path:
    """Write out_dir/<op>.json: the committed table of `op` with `entries` (shape key ->
    config) merged in under `device` (a device_key). Copy it into CONFIG_DIR to keep it;
    the committed table itself is only read."""
    merged = _read(CONFIG_DIR / f"{op}.json")
    merged.setdefault(device, {}).update(entries)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{op}.json"
    path.write_text(json.dumps(merged, indent=1) + "\n")
    return path
