"""A MoE layer's weights as the fused kernel reads them: each layer's gate and up
projections stacked into one [E, 2I, D] tensor (and the shared expert's into [2Is, D]),
with the per-projection parameters re-pointed as views of it, so no memory is added and
the torch code still reads them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.backends.cuda.norm_linear import KERNEL_DTYPES


@dataclass
class FusedExperts:
    """One MoE layer's experts as the fused kernel reads them (views of the parameters)."""

    fmt: str  # "bf16" | "fp8" | "mxfp4" (fused_moe's names)
    w13: torch.Tensor  # [E, 2I, D(/2)] gate rows, then up rows
    w2: torch.Tensor  # [E, D, I(/2)]
    w13_scale: torch.Tensor | None
    w2_scale: torch.Tensor | None


def _stack_pair(gate: torch.nn.Module, up: torch.nn.Module, leaf: str) -> torch.Tensor:
    """cat(gate.leaf, up.leaf) along the output rows; both parameters become views of it."""
    a, b = getattr(gate, leaf), getattr(up, leaf)
    both = torch.cat((a.data, b.data), dim=1)
    rows = a.shape[1]
    a.data, b.data = both[:, :rows], both[:, rows:]
    return both


def stack_experts(experts) -> FusedExperts | None:
    """The fused kernel's view of a layer's experts, or None where it cannot read them."""
    gate, up, down = experts.gate_proj, experts.up_proj, experts.down_proj
    if not gate.device_ids:
        return None  # every expert of the layer is on the host
    name = gate.format.name
    if name == "unquantized":
        if gate.weight.dtype not in KERNEL_DTYPES:
            return None
        fmt, leaf = "bf16", None
    elif name.startswith("fp8_block"):
        if gate.out_features % 128:
            return None  # gate and up scale grids would share a 128-row block
        fmt, leaf = "fp8", gate.format.scale_name
    elif name == "mxfp4":
        fmt, leaf = "mxfp4", "scale"
        _check_mxfp4_scales(experts)
    else:
        return None
    w13 = _stack_pair(gate, up, "weight")
    s13 = _stack_pair(gate, up, leaf) if leaf else None
    s2 = getattr(down, leaf) if leaf else None
    return FusedExperts(fmt, w13, down.weight, s13, s2)


def _check_mxfp4_scales(experts) -> None:
    """The fused kernel decodes MXFP4 exactly only up to a scale of 2^1 (|w| <= 12); a
    checkpoint beyond that is refused by name rather than computed wrong."""
    from kernels.triton.fused_moe import MXFP4_MAX_EXACT_SCALE

    for proj in (experts.gate_proj, experts.up_proj, experts.down_proj):
        largest = int(proj.scale.max())
        if largest > MXFP4_MAX_EXACT_SCALE:
            raise ValueError(
                f"{proj.prefix}.scale: MXFP4 scale byte {largest} "
                f"(2^{largest - 127}) is above the GPU kernel's exact range "
                f"(<= {MXFP4_MAX_EXACT_SCALE}, 2^1); weights this large are not expected "
                "in a real checkpoint"
            )


def _format_of(linear) -> tuple[str, str | None] | None:
    """(fused_moe format, scale attribute) of a dense linear, or None if the kernels cannot
    read it."""
    name = linear.format.name
    if name == "unquantized":
        return ("bf16", None) if linear.weight.dtype in KERNEL_DTYPES else None
    if name.startswith("fp8_block"):
        return "fp8", linear.format.scale_name
    return None


def stack_shared_expert(mlp):
    """The shared expert (a SwiGluMlp) as a fused_moe.SharedExpert: gate and up stacked into
    one [2Is, D] weight (the parameters become views of it), or None."""
    from kernels.triton.fused_moe import SharedExpert

    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    fmts = {_format_of(gate), _format_of(up), _format_of(down)}
    if len(fmts) != 1 or None in fmts:
        return None
    fmt, leaf = fmts.pop()
    if fmt == "fp8" and gate.out_features % 128:
        return None  # gate and up scale grids would share a 128-row block

    def stack(leaf_name: str) -> torch.Tensor:
        a, b = getattr(gate, leaf_name), getattr(up, leaf_name)
        both = torch.cat((a.data, b.data), dim=0)
        a.data, b.data = both[: a.shape[0]], both[a.shape[0] :]
        return both

    w13 = stack("weight")
    s13 = stack(leaf) if leaf else None
    s2 = getattr(down, leaf) if leaf else None
    return SharedExpert(fmt, w13, down.weight, s13, s2)
