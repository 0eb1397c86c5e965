"""Per-step figures of a model whose routed experts are split between the GPU and the host
(expert offload, issue 24), for `bench decode-moe --expert-offload`:

- the host's share: distinct host experts, (token, expert) pairs and the share of all
  routes they are, bytes of host experts read, seconds of host work per step (the CPU
  kernel inside the graph's host nodes, or the copies with expert_offload_compute "pcie");
- the GPU's own time: a decode graph replayed with its host nodes returning at once, so
  `gpu_wait_ms` = replay with host work - replay without it is the time the GPU stood
  waiting for the CPU;
- the transfers: the pinned copies a split layer makes per step (its input, routing and
  result), timed alone at the step's size, times the split layers;
- the bounds: the host experts' bytes over the host's measured read bandwidth, and the
  rest of the step's bytes over the GPU's copy bandwidth; `bound_ratio` is the step time
  over the larger.
"""

from __future__ import annotations

import torch

from engine.layers.moe import DeepseekMoE


def split_layers(llm) -> list[tuple[DeepseekMoE, object]]:
    """(MoE layer, its split: SplitExperts or CopiedExperts) for each layer with host
    experts."""
    model = llm.engine.runner.model
    return [
        (m, m.ops.split)
        for m in model.modules()
        if isinstance(m, DeepseekMoE) and getattr(m.ops, "split", None) is not None
    ]


def reset(llm) -> None:
    for _, split in split_layers(llm):
        split.times.reset()


def host_step(llm, tokens: int) -> dict | None:
    """The host's share of one step of `tokens` tokens, from the split layers' calls of that
    size since `reset` (None: no call of that size)."""
    layers = split_layers(llm)
    calls = [(m, split.times.per_call(tokens)) for m, split in layers]
    if not calls or any(c is None for _, c in calls):
        return None
    moe_layers = sum(isinstance(m, DeepseekMoE) for m in llm.engine.runner.model.modules())
    top_k = layers[0][0].gate.spec.top_k
    pairs = sum(c["pairs"] for _, c in calls)
    return {
        "split_layers": len(layers),
        "calls_per_layer": min(c["calls"] for _, c in calls),
        "host_ms": 1e3 * sum(c["s"] for _, c in calls),
        "host_wait_for_inputs_ms": 1e3 * sum(c["wait_s"] for _, c in calls),
        "host_experts": sum(c["experts"] for _, c in calls),
        "host_pairs": pairs,
        "host_route_share": pairs / (tokens * top_k * moe_layers),
        "host_expert_bytes": sum(c["experts"] * m.experts.bytes_per_expert() for m, c in calls),
        "copied_bytes": sum(c["bytes"] for _, c in calls),
    }


def gpu_only_replay_ms(llm, batch: int, graph_replay_ms) -> tuple[float | None, float | None]:
    """(replay ms with the host work, replay ms with the host nodes returning at once) of
    `batch`'s decode graph; (None, None) without graphs."""
    runner = llm.engine.runner
    with_host = graph_replay_ms(runner, batch)
    if with_host is None:
        return None, None
    splits = [split for _, split in split_layers(llm) if hasattr(split, "skip_host")]
    for split in splits:
        split.skip_host = True
    try:
        without = graph_replay_ms(runner, batch)
    finally:
        for split in splits:
            split.skip_host = False
    return with_host, without


def transfer_ms(device: torch.device, tokens: int, hidden: int, top_k: int, layers: int) -> float:
    """The pinned copies of `layers` split layers' calls at `tokens` tokens (x, weights and
    ids to the host, the float32 result back), timed alone with CUDA events."""
    x = torch.zeros((tokens, hidden), dtype=torch.float32, device=device)
    w = torch.zeros((tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.zeros((tokens, top_k), dtype=torch.int32, device=device)
    hx, hw, hi = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (x, w, ids))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    for timed in (False, True):
        if timed:
            start.record()
        for _ in range(reps * layers):
            hx.copy_(x, non_blocking=True)
            hw.copy_(w, non_blocking=True)
            hi.copy_(ids, non_blocking=True)
            x.copy_(hx, non_blocking=True)
        if timed:
            end.record()
        torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def offload_figures(llm, batch: int, step_ms: float, step_bytes: float, copy_bps: float,
                    host_bps: float, host: dict | None, graph_replay_ms) -> dict:  # fmt: skip
    """The row's `offload` entry (module docstring); `host` is host_step's for the
    measured decode steps, `step_bytes` the whole step's reads as if all on the GPU."""
    runner = llm.engine.runner
    out: dict = {"compute": runner.config.expert_offload_compute, "host": host}
    if host is None:
        return out
    with_host, gpu_only = gpu_only_replay_ms(llm, batch, graph_replay_ms)
    moe = split_layers(llm)[0][0]
    hidden, top_k = moe.gate.weight.shape[1], moe.gate.spec.top_k
    cpu_bound = 1e3 * host["host_expert_bytes"] / host_bps
    gpu_bound = 1e3 * max(step_bytes - host["host_expert_bytes"], 0.0) / copy_bps
    out |= {
        "replay_ms": with_host,
        "gpu_only_ms": gpu_only,
        "gpu_wait_ms": None if gpu_only is None else with_host - gpu_only,
        "transfer_ms": None
        if out["compute"] != "cpu"
        else transfer_ms(runner.device, batch, hidden, top_k, host["split_layers"]),
        "cpu_bound_ms": cpu_bound,
        "gpu_bound_ms": gpu_bound,
        "bound_ratio": step_ms / max(cpu_bound, gpu_bound),
    }
    return out
