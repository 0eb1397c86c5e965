"""How a MoE layer stores all E experts of one projection, stacked, and multiplies by one.

The experts of a layer are kept as [E, out, in] tensors (plus stacked scales) in the
checkpoint's own format, so a step reads each expert it routes to from one contiguous
slice and a fused kernel can index them by expert id. This is the stacked twin of
`WeightFormat` (engine/quant/base.py): the formats in fp8_block.py and mxfp4.py implement
both; `UnquantizedExperts` is the plain-float one. Tensor names on the module equal the
per-expert checkpoint suffixes (`weight`, `weight_scale_inv`, `scale`), so the loader copies
`...experts.{e}.gate_proj.weight_scale_inv` into `...experts.gate_proj.weight_scale_inv[e]`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from kernels.cpu import batch_invariant
from kernels.formats.e8m0 import check_e8m0, e8m0_bytes

# Dequantize-on-the-fly works on row tiles of about this many elements, so no full float
# copy of a large weight exists at once.
TILE_ELEMENTS = 1 << 22


def tile_rows(in_features: int, align: int = 128) -> int:
    rows = max(align, TILE_ELEMENTS // max(in_features, 1))
    return rows - rows % align


def tiled_matmul(x: torch.Tensor, out_features: int, in_features: int, rows_of) -> torch.Tensor:
    """y = x W^T where `rows_of(r0, r1, dtype)` dequantizes W[r0:r1] (computed in x's dtype)."""
    step = tile_rows(in_features)
    if step >= out_features:
        return batch_invariant.linear(x, rows_of(0, out_features, x.dtype))
    y = x.new_empty(*x.shape[:-1], out_features)
    for r0 in range(0, out_features, step):
        r1 = min(out_features, r0 + step)
        y[..., r0:r1] = batch_invariant.linear(x, rows_of(r0, r1, x.dtype))
    return y


def expert_tensor_name(prefix: str, expert: int, leaf: str) -> str:
    """`...experts.gate_proj` + 5 + `scale` -> the checkpoint's `...experts.5.gate_proj.scale`."""
    owner, _, proj = prefix.rpartition(".")
    return f"{owner}.{expert}.{proj}.{leaf}"


def check_expert_e8m0(scale: torch.Tensor, prefix: str, leaf: str, expert_ids=None) -> None:
    """Reject NaN (255) E8M0 scales, naming the first bad expert's own tensor; `expert_ids`
    gives each slot's expert id where the stack holds only some of the layer's experts."""
    bad = e8m0_bytes(scale) == 255
    if bool(bad.any()):
        slot = int(bad.nonzero()[0, 0])
        expert = expert_ids[slot] if expert_ids is not None else slot
        check_e8m0(scale[slot], expert_tensor_name(prefix, expert, leaf))


def stored_param(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class ExpertWeightFormat(ABC):
    name: str = "abstract"

    @abstractmethod
    def create_expert_weights(
        self,
        module: nn.Module,
        num_experts: int,
        in_features: int,
        out_features: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register the stacked stored tensors [E, ...] on `module`."""

    def process_expert_weights_after_loading(self, module: nn.Module, prefix: str) -> None:
        """Validate or repack once after loading (`prefix` names the tensors in errors)."""

    @abstractmethod
    def expert_weight(self, module: nn.Module, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `expert`'s weight [out, in] dequantized to `dtype` (references, tests)."""

    @abstractmethod
    def apply_expert(self, module: nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> x W_e^T [N, out] in x's dtype."""

    def bytes_per_expert(self, module: nn.Module) -> int:
        """Bytes one expert's stored tensors occupy (what routing to it reads)."""
        total = 0
        for tensor in module.parameters(recurse=False):
            total += tensor.shape[1:].numel() * tensor.element_size()
        return total


class UnquantizedExperts(ExpertWeightFormat):
    name = "unquantized"

    def create_expert_weights(self, module, num_experts, in_features, out_features, params_dtype):
        module.weight = stored_param((num_experts, out_features, in_features), params_dtype)

    def expert_weight(self, module, expert, dtype):
        return module.weight[expert].to(dtype)

    def apply_expert(self, module, expert, x):
        return batch_invariant.linear(x.to(module.weight.dtype), module.weight[expert]).to(x.dtype)
