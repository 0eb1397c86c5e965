"""FP8 E4M3 weights with 128x128 block scales, kept as stored (1 byte per weight).

DeepSeek-V3 names the scale `weight_scale_inv` (float32); DeepSeek-V4 names it `scale`
(E8M0, stored uint8 / float8_e8m0fnu). Both mean W = q * s[o // 128, i // 128]. The CPU
path dequantizes row tiles on the fly (engine/quant/expert_format.py: tiled_matmul); the
CUDA backend's linear and MoE ops run kernels over the same tensors.
"""

from __future__ import annotations

import torch

from engine.quant.base import WeightFormat
from engine.quant.expert_format import (
    ExpertWeightFormat,
    check_expert_e8m0,
    stored_param,
    tiled_matmul,
)
from kernels.formats.e8m0 import check_e8m0
from kernels.formats.fp8 import BLOCK, FP8_DTYPE, dequantize_fp8_block, scale_grid

SCALE_NAMES = {"float32": "weight_scale_inv", "e8m0": "scale"}


class Fp8BlockFormat(WeightFormat, ExpertWeightFormat):
    name = "fp8_block"

    def __init__(self, scale_format: str = "float32", block: tuple[int, int] = (BLOCK, BLOCK)):
        if scale_format not in SCALE_NAMES:
            raise ValueError(f"FP8 scale format must be one of {list(SCALE_NAMES)}")
        if tuple(block) != (BLOCK, BLOCK):
            raise ValueError(f"only {BLOCK}x{BLOCK} FP8 weight blocks are supported, got {block}")
        self.scale_format = scale_format
        self.scale_name = SCALE_NAMES[scale_format]
        self.scale_dtype = torch.float32 if scale_format == "float32" else torch.uint8
        self.name = f"fp8_block_{scale_format}"

    # -- one linear layer --------------------------------------------------------------
    def create_weights(self, layer, in_features, out_features, params_dtype):
        layer.weight = stored_param((out_features, in_features), FP8_DTYPE)
        grid = scale_grid(out_features, in_features)
        setattr(layer, self.scale_name, stored_param(grid, self.scale_dtype))

    def process_weights_after_loading(self, layer):
        if self.scale_format == "e8m0":
            check_e8m0(getattr(layer, self.scale_name), f"{layer.prefix}.{self.scale_name}")

    def apply(self, layer, x):
        weight, scale = layer.weight, getattr(layer, self.scale_name)
        return tiled_matmul(
            x,
            weight.shape[0],
            weight.shape[1],
            lambda r0, r1, dtype: dequantize_fp8_block(weight, scale, r0, r1, dtype),
        )

    def dequantize(self, layer):
        return dequantize_fp8_block(layer.weight, getattr(layer, self.scale_name))

    # -- stacked experts ---------------------------------------------------------------
    def create_expert_weights(self, module, num_experts, in_features, out_features, params_dtype):
        module.weight = stored_param((num_experts, out_features, in_features), FP8_DTYPE)
        grid = scale_grid(out_features, in_features)
        setattr(module, self.scale_name, stored_param((num_experts, *grid), self.scale_dtype))

    def process_expert_weights_after_loading(self, module, prefix):
        if self.scale_format == "e8m0":
            check_expert_e8m0(
                getattr(module, self.scale_name), prefix, self.scale_name,
                getattr(module, "device_ids", None),
            )  # fmt: skip

    def expert_weight(self, module, expert, dtype):
        scale = getattr(module, self.scale_name)[expert]
        return dequantize_fp8_block(module.weight[expert], scale, dtype=dtype)

    def apply_expert(self, module, expert, x):
        weight, scale = module.weight[expert], getattr(module, self.scale_name)[expert]
        return tiled_matmul(
            x,
            weight.shape[0],
            weight.shape[1],
            lambda r0, r1, dtype: dequantize_fp8_block(weight, scale, r0, r1, dtype),
        )
