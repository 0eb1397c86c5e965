"""Per-step, per-MoE-layer routing statistics: distinct experts touched and expert bytes read.

Off by default: the model's MoE layers hold `routing_recorder = None` and check that one
attribute. When on, the engine calls `begin_step(num_tokens, is_decode, group)` before
each forward and every MoE layer calls `record(layer, expert_ids, bytes_per_expert)`.
Bytes are distinct experts x the bytes one expert occupies in its stored format (gate +
up + down, with their scales): what a step must read from memory for the routed experts.

Statistics are kept as running sums per (step kind, group, layer), so an overnight run of
millions of steps records in constant memory. `group` is the batch's dominant task
cluster (the engine passes it), which lets reports show experts read per cluster.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class _Sums:
    steps: int = 0
    tokens: int = 0
    # layer -> [steps that touched the layer, sum of distinct experts, sum of bytes]
    layers: dict[int, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0, 0]))


class RoutingRecorder:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._sums: dict[tuple[bool, int | None], _Sums] = defaultdict(_Sums)
        self._current: tuple[bool, int | None] | None = None
        self._seen: set[int] = set()
        # layer -> routes per expert id over every step (what expert placement ranks by)
        self._routes: dict[int, torch.Tensor] = {}

    def begin_step(self, num_tokens: int, is_decode: bool, group: int | None = None) -> None:
        self._current = (bool(is_decode), group)
        sums = self._sums[self._current]
        sums.steps += 1
        sums.tokens += int(num_tokens)
        self._seen = set()

    def record(self, layer: int, expert_ids: torch.Tensor, bytes_per_expert: int) -> None:
        if self._current is None:
            raise RuntimeError("RoutingRecorder.record before begin_step")
        distinct = int(torch.unique(expert_ids).numel())
        counts = torch.bincount(expert_ids.reshape(-1).long().cpu())
        seen = self._routes.get(layer)
        if seen is not None and seen.numel() > counts.numel():
            counts = torch.nn.functional.pad(counts, (0, seen.numel() - counts.numel()))
        elif seen is not None:
            seen = torch.nn.functional.pad(seen, (0, counts.numel() - seen.numel()))
        self._routes[layer] = counts if seen is None else seen + counts
        entry = self._sums[self._current].layers[layer]
        # A layer seen twice in one step (e.g. the MTP layer run for several drafts) adds
        # up into that step's figure, and counts as one step for the mean.
        if layer not in self._seen:
            entry[0] += 1
            self._seen.add(layer)
        entry[1] += distinct
        entry[2] += distinct * bytes_per_expert

    def summary(self) -> dict:
        """Per-layer means over steps: all steps, decode-only, prefill-only, and decode
        steps per dominant group."""
        every = list(self._sums.items())
        decode = [s for (is_decode, _), s in every if is_decode]
        groups = sorted({g for (d, g), _ in every if d and g is not None})
        return {
            "steps": sum(s.steps for _, s in every),
            "tokens": sum(s.tokens for _, s in every),
            "all": _aggregate([s for _, s in every]),
            "decode": _aggregate(decode),
            "prefill": _aggregate([s for (is_decode, _), s in every if not is_decode]),
            "decode_by_group": {
                g: _aggregate([s for (d, gg), s in every if d and gg == g]) for g in groups
            },
            "expert_routes": {
                layer: counts.tolist() for layer, counts in sorted(self._routes.items())
            },
        }


def _aggregate(parts: list[_Sums]) -> dict:
    totals: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    for part in parts:
        for layer, (n, distinct, nbytes) in part.layers.items():
            t = totals[layer]
            t[0] += n
            t[1] += distinct
            t[2] += nbytes
    per_layer = {
        layer: {
            "mean_distinct_experts": distinct / n,
            "mean_expert_bytes": nbytes / n,
        }
        for layer, (n, distinct, nbytes) in sorted(totals.items())
    }
    steps = sum(p.steps for p in parts)
    tokens = sum(p.tokens for p in parts)
    return {
        "steps": steps,
        "mean_tokens_per_step": tokens / steps if steps else 0.0,
        "layers": per_layer,
        "mean_distinct_experts": (
            sum(v["mean_distinct_experts"] for v in per_layer.values()) / len(per_layer)
            if per_layer
            else 0.0
        ),
        "expert_bytes_per_step": sum(v["mean_expert_bytes"] for v in per_layer.values()),
    }
