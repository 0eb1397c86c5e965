"""Per-step, per-MoE-layer routing statistics: distinct experts touched and expert bytes read.

Off by default: the model's MoE layers hold `routing_recorder = None` and check that one
attribute. When on, the engine calls `begin_step(num_tokens, is_decode)` before each
forward and every MoE layer calls `record(layer, expert_ids, bytes_per_expert)`. Bytes
are distinct experts x the bytes one expert occupies in its stored format (gate + up +
down, with their scales): what a step must read from memory for the routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepRouting:
    num_tokens: int
    is_decode: bool
    distinct_experts: dict[int, int] = field(default_factory=dict)  # layer -> count
    expert_bytes: dict[int, int] = field(default_factory=dict)  # layer -> bytes


class RoutingRecorder:
    def __init__(self) -> None:
        self.steps: list[StepRouting] = []

    def begin_step(self, num_tokens: int, is_decode: bool) -> None:
        self.steps.append(StepRouting(int(num_tokens), bool(is_decode)))

    def record(self, layer: int, expert_ids: torch.Tensor, bytes_per_expert: int) -> None:
        if not self.steps:
            raise RuntimeError("RoutingRecorder.record before begin_step")
        step = self.steps[-1]
        distinct = int(torch.unique(expert_ids).numel())
        # A layer seen twice in one step (e.g. the MTP layer run for several drafts) adds up.
        step.distinct_experts[layer] = step.distinct_experts.get(layer, 0) + distinct
        step.expert_bytes[layer] = step.expert_bytes.get(layer, 0) + distinct * bytes_per_expert

    def reset(self) -> None:
        self.steps.clear()

    def summary(self) -> dict:
        """Per-layer means over steps, for all steps and for decode-only steps."""
        return {
            "steps": len(self.steps),
            "tokens": sum(s.num_tokens for s in self.steps),
            "all": _aggregate(self.steps),
            "decode": _aggregate([s for s in self.steps if s.is_decode]),
            "prefill": _aggregate([s for s in self.steps if not s.is_decode]),
        }


def _aggregate(steps: list[StepRouting]) -> dict:
    layers = sorted({layer for s in steps for layer in s.distinct_experts})
    per_layer = {}
    for layer in layers:
        seen = [s for s in steps if layer in s.distinct_experts]
        per_layer[layer] = {
            "mean_distinct_experts": sum(s.distinct_experts[layer] for s in seen) / len(seen),
            "mean_expert_bytes": sum(s.expert_bytes[layer] for s in seen) / len(seen),
        }
    n = len(steps)
    return {
        "steps": n,
        "mean_tokens_per_step": sum(s.num_tokens for s in steps) / n if n else 0.0,
        "layers": per_layer,
        "mean_distinct_experts": (
            sum(v["mean_distinct_experts"] for v in per_layer.values()) / len(per_layer)
            if per_layer
            else 0.0
        ),
        "expert_bytes_per_step": sum(v["mean_expert_bytes"] for v in per_layer.values()),
    }
