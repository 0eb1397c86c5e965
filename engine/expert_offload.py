"""Choosing the expert placement for a model about to be built (EngineConfig.expert_offload).

The model is first built on the meta device (no memory) to learn its dense weights' bytes
and each MoE layer's expert count and bytes per expert; then "auto" gives the GPU's free
memory, less the dense weights and the reserves below, to as many experts as fit
(engine/expert_placement.py plan_auto), and a placement file is checked against the model.
"""

from __future__ import annotations

import dataclasses
import logging
import sys

import torch

from engine.expert_placement import (
    NO_OFFLOAD,
    MoeLayerShape,
    load_placement,
    load_route_counts,
    placing_experts,
    plan_auto,
)

log = logging.getLogger(__name__)

# Kept free on the GPU besides the dense weights when "auto" places experts: the KV cache
# when the user gives no size (a minimum: the cache takes whatever is left), and the
# activations, CUDA graph pools and cuBLAS workspaces of the largest step.
DEFAULT_KV_RESERVE_BYTES = 4 << 30
WORKSPACE_RESERVE_BYTES = 3 << 30
FREE_MEMORY_SHARE = 0.97


def model_shapes(model_cls, config: dict, quant_config, dtype) -> tuple[list[MoeLayerShape], int]:
    """(MoE layers' shapes, dense bytes: every parameter that is not a routed expert's),
    from the model built on the meta device."""
    from engine.layers.moe import DeepseekMoE, ExpertProjection

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"), placing_experts(NO_OFFLOAD):
            model = model_cls(config, quant_config)
    finally:
        torch.set_default_dtype(previous)
    expert_params = {
        id(p)
        for m in model.modules()
        if isinstance(m, ExpertProjection)
        for p in m.parameters(recurse=False)
    }
    dense = sum(
        p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_params
    )
    shapes = [
        MoeLayerShape(m.layer_index, m.experts.num_experts, m.experts.bytes_per_expert())
        for m in model.modules()
        if isinstance(m, DeepseekMoE)
    ]
    return shapes, dense


def choose_placement(engine_config, model_cls, source, device: torch.device, dtype):
    """(placement, summary for the log and reports; None where nothing is placed)."""
    mode = engine_config.expert_offload
    if mode == "off":
        return NO_OFFLOAD, None
    shapes, dense = model_shapes(model_cls, source.config, source.quant_config, dtype)
    if not shapes:
        raise ValueError(f"expert_offload={mode!r}: {source.name} has no routed experts")
    stats = engine_config.expert_routing_stats
    routes = load_route_counts(stats) if stats else None
    if mode == "auto":
        if device.type != "cuda":
            return NO_OFFLOAD, None  # the host is the device: every expert is "resident"
        placement = plan_auto(shapes, _device_budget(engine_config, device, dense, shapes), routes)
    else:
        placement = load_placement(mode)
        placement.check(shapes, f"expert placement {mode}")
    compute = engine_config.expert_offload_compute
    if compute == "pcie" and device.type != "cuda":
        raise ValueError(
            f"expert_offload_compute='pcie' copies host experts to a GPU; the device is {device}"
        )
    placement = dataclasses.replace(placement, compute=compute)
    on_gpu_run = placement.offloads and device.type == "cuda" and compute == "cpu"
    threads = _give_the_cores_to_the_host_experts() if on_gpu_run else {}
    summary = placement.summary(shapes, routes) | threads
    summary["mode"] = "auto" if mode == "auto" else "file"
    summary["compute"] = compute
    summary["dense_bytes"] = dense
    share = summary["expected_host_route_share"]
    log.info(
        "expert placement (%s): %d experts on %s, %d on the host (%.1f GiB); expected share "
        "of routes on the host: %s",
        summary["mode"],
        summary["experts_on_device"],
        device,
        summary["experts_on_host"],
        summary["host_expert_bytes"] / 2**30,
        "unknown (no routing statistics)" if share is None else f"{share:.1%}",
    )
    return placement, summary


def _device_budget(engine_config, device, dense: int, shapes: list[MoeLayerShape]) -> int:
    """Bytes the GPU can give to routed experts: its free memory, less the dense weights,
    the KV reserve, the workspace reserve, and one layer's gate + up (the fused kernels'
    stacking concatenates them once per layer at start-up)."""
    free, _ = torch.cuda.mem_get_info(device)
    kv = engine_config.kv_cache_memory or DEFAULT_KV_RESERVE_BYTES
    stacking = max(s.num_experts * s.bytes_per_expert * 2 // 3 for s in shapes)
    budget = int(free * FREE_MEMORY_SHARE) - dense - kv - WORKSPACE_RESERVE_BYTES - stacking
    return max(budget, 0)


# torch's own CPU pool on a GPU run with host experts: the host's work is the expert
# kernel's (numba's pool); a small torch pool keeps the two from spinning on each other's
# cores (docs/notes-cpu-decode.md).
TORCH_THREADS_WITH_HOST_EXPERTS = 2
# A captured step's host work is a Python callable on the CUDA driver's thread, which waits
# for the GIL while the main thread runs the scheduler: Python hands the GIL over only
# every switch interval (5 ms by default), longer than a decode step.
SWITCH_INTERVAL_WITH_HOST_EXPERTS_S = 1e-4


def _give_the_cores_to_the_host_experts() -> dict:
    import os

    import numba

    from kernels.cpu.host_experts import set_threads

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch_threads = min(TORCH_THREADS_WITH_HOST_EXPERTS, cores)
    torch.set_num_threads(torch_threads)
    numba_threads = max(1, min(numba.config.NUMBA_NUM_THREADS, cores - torch_threads))
    set_threads(numba_threads)  # in every thread a host call runs on, the driver's too
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_WITH_HOST_EXPERTS_S))
    return {"torch_threads": torch_threads, "numba_threads": numba_threads}
