"""Which routed experts live on the device and which in host RAM, computed there.

A MoE model whose experts do not all fit the GPU keeps the rest in host memory in their
stored format and computes them on the CPU (engine/layers/host_experts.py holds them,
engine/ops/moe.py combines the two parts). An `ExpertPlacement` names, per MoE layer, the
experts on the host; every other expert is on the model's device.

Placements come from `EngineConfig.expert_offload`:
- "off": every expert on the device (the default; on a CPU-only machine the host is the
  device, so "auto" places nothing on the "host" either);
- "auto": after the dense weights and the memory reserved for the KV cache, CUDA graphs and
  activations, as many experts as fit go to the device, chosen per layer by how often they
  are routed (a routing-statistics file, `batchgen bench routing --out FILE`), else the
  lowest ids first, every layer taking its share of the budget;
- a placement file (JSON, `{"version": 1, "host": {"<layer>": [expert ids]}}`), written by
  `ExpertPlacement.save` or by hand.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

PLACEMENT_VERSION = 1

# How host experts are computed (EngineConfig.expert_offload_compute): "cpu", by the CPU
# kernel where they live (the design); "pcie", copied to the GPU each step that routes to
# them and computed there (the way this design replaces, kept to measure against).
HOST_COMPUTE = ("cpu", "pcie")


@dataclass(frozen=True)
class MoeLayerShape:
    """What placing one MoE layer needs to know: its expert count and the stored bytes of
    one expert (gate + up + down with their scales)."""

    layer: int
    num_experts: int
    bytes_per_expert: int


@dataclass(frozen=True)
class ExpertPlacement:
    """layer index -> the expert ids kept on the host (sorted; absent: none), and how a
    step computes them (`compute`, one of HOST_COMPUTE)."""

    host: dict[int, tuple[int, ...]] = field(default_factory=dict)
    compute: str = "cpu"

    def host_experts(self, layer: int) -> tuple[int, ...]:
        return self.host.get(layer, ())

    @property
    def offloads(self) -> bool:
        return any(self.host.values())

    def check(self, layers: list[MoeLayerShape], source: str = "placement") -> None:
        """Refuse a placement naming a layer or expert the model does not have."""
        known = {s.layer: s for s in layers}
        for layer, experts in self.host.items():
            shape = known.get(layer)
            if shape is None:
                raise ValueError(
                    f"{source}: layer {layer} is not a MoE layer of this model "
                    f"(MoE layers: {sorted(known)})"
                )
            bad = [e for e in experts if not 0 <= e < shape.num_experts]
            if bad:
                raise ValueError(
                    f"{source}: layer {layer} names experts {bad[:5]} outside "
                    f"0..{shape.num_experts - 1}"
                )

    def summary(self, layers: list[MoeLayerShape], routes: dict[int, list[float]] | None):
        """The placement as the log, report.json and the report show it: experts per layer
        on each side, host bytes, and the expected share of routes computed on the host
        (from routing statistics; None without them)."""
        per_layer = {}
        host_bytes = 0
        expected, total = 0.0, 0.0
        for s in layers:
            on_host = self.host_experts(s.layer)
            host_bytes += len(on_host) * s.bytes_per_expert
            per_layer[s.layer] = {"device": s.num_experts - len(on_host), "host": len(on_host)}
            counts = (routes or {}).get(s.layer)
            if counts:
                expected += sum(counts[e] for e in on_host if e < len(counts))
                total += sum(counts)
        return {
            "experts_on_device": sum(v["device"] for v in per_layer.values()),
            "experts_on_host": sum(v["host"] for v in per_layer.values()),
            "host_expert_bytes": host_bytes,
            "expected_host_route_share": (expected / total) if total else None,
            "layers": per_layer,
        }

    def save(self, path: str | Path) -> None:
        blob = {
            "version": PLACEMENT_VERSION,
            "host": {str(k): list(v) for k, v in sorted(self.host.items()) if v},
        }
        Path(path).write_text(json.dumps(blob, indent=1) + "\n")


def load_placement(path: str | Path) -> ExpertPlacement:
    """A placement file, validated: its problems name the file and the key."""
    path = Path(path)
    try:
        blob = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"expert placement {path}: cannot read it ({exc})") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"expert placement {path} is not valid JSON: {exc}") from exc
    if not isinstance(blob, dict) or blob.get("version") != PLACEMENT_VERSION:
        raise ValueError(f'expert placement {path}: needs "version": {PLACEMENT_VERSION}')
    host = blob.get("host")
    if not isinstance(host, dict):
        raise ValueError(f'expert placement {path}: "host" must map layer -> expert ids')
    placed: dict[int, tuple[int, ...]] = {}
    for key, experts in host.items():
        if not str(key).isdigit():
            raise ValueError(f"expert placement {path}: layer key {key!r} is not an integer")
        ok = isinstance(experts, list) and all(
            isinstance(e, int) and not isinstance(e, bool) for e in experts
        )
        if not ok or len(set(experts)) != len(experts):
            raise ValueError(
                f"expert placement {path}: host[{key!r}] must be a list of distinct expert ids"
            )
        placed[int(key)] = tuple(sorted(experts))
    return ExpertPlacement(placed)


def load_route_counts(path: str | Path) -> dict[int, list[float]]:
    """Per-layer route counts per expert from a routing-statistics file
    (`batchgen bench routing --out FILE`: {"expert_routes": {"<layer>": [count per expert]}})."""
    path = Path(path)
    try:
        blob = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"routing statistics {path}: cannot read it ({exc})") from exc
    routes = blob.get("expert_routes") if isinstance(blob, dict) else None
    if not isinstance(routes, dict):
        raise ValueError(f'routing statistics {path}: no "expert_routes" per layer')
    out = {}
    for key, counts in routes.items():
        if not str(key).isdigit() or not isinstance(counts, list):
            raise ValueError(f"routing statistics {path}: expert_routes[{key!r}] is not a list")
        out[int(key)] = [float(c) for c in counts]
    return out


def plan_auto(
    layers: list[MoeLayerShape],
    device_budget: int,
    routes: dict[int, list[float]] | None = None,
) -> ExpertPlacement:
    """Fill `device_budget` bytes with experts: the most routed first across all layers
    (a route saved is a route saved wherever it is), ties and layers without statistics
    taking the lowest ids first, with every layer given its fair share before any layer's
    rarely routed experts. Whatever does not fit goes to the host."""
    candidates = []  # (-route share, rank within the layer, layer, expert, bytes)
    for s in layers:
        counts = (routes or {}).get(s.layer)
        total = sum(counts) if counts else 0.0
        for e in range(s.num_experts):
            share = counts[e] / total if total and e < len(counts) else 1.0 / s.num_experts
            candidates.append((-share, e, s.layer, s.bytes_per_expert))
    if routes:
        candidates.sort(key=lambda c: (c[0], c[2], c[1]))
    else:  # no statistics: the lowest ids of every layer first, layer by layer round robin
        candidates.sort(key=lambda c: (c[1], c[2]))
    on_device: dict[int, set[int]] = {s.layer: set() for s in layers}
    left = device_budget
    for _, expert, layer, nbytes in candidates:
        if nbytes <= left:
            on_device[layer].add(expert)
            left -= nbytes
    host = {
        s.layer: tuple(e for e in range(s.num_experts) if e not in on_device[s.layer])
        for s in layers
    }
    return ExpertPlacement({k: v for k, v in host.items() if v})


NO_OFFLOAD = ExpertPlacement()
_BUILDING: ContextVar[ExpertPlacement] = ContextVar("expert_placement", default=NO_OFFLOAD)


@contextmanager
def placing_experts(placement: ExpertPlacement) -> Iterator[None]:
    """While a model is constructed, its MoE layers take their host experts from
    `placement` (as torch.device(...) gives the device): the model families' constructors
    need no placement argument of their own."""
    token = _BUILDING.set(placement)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def building_placement() -> ExpertPlacement:
    return _BUILDING.get()
