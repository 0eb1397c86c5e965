"""MXFP4 weights kept packed: `weight` uint8 [out, in/2] (two E2M1 codes per byte, low
nibble = even input index) and `scale` E8M0 uint8 [out, in/32], as DeepSeek-V4 ships its
experts (`expert_dtype: fp4`). 0.53 bytes per weight. A scale of 255 (NaN) is rejected at
load, naming the tensor. The CPU path dequantizes row tiles on the fly.
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
from kernels.formats.mxfp4 import GROUP, dequantize_mxfp4


def _check_shape(in_features: int, where: str) -> None:
    if in_features % GROUP:
        raise ValueError(
            f"{where}: MXFP4 needs the input dimension to be a multiple of {GROUP}, "
            f"got {in_features}"
        )


class Mxfp4Format(WeightFormat, ExpertWeightFormat):
    name = "mxfp4"

    # -- one linear layer --------------------------------------------------------------
    def create_weights(self, layer, in_features, out_features, params_dtype):
        _check_shape(in_features, layer.prefix)
        layer.weight = stored_param((out_features, in_features // 2), torch.uint8)
        layer.scale = stored_param((out_features, in_features // GROUP), torch.uint8)

    def process_weights_after_loading(self, layer):
        check_e8m0(layer.scale, f"{layer.prefix}.scale")

    def apply(self, layer, x):
        weight, scale = layer.weight, layer.scale
        return tiled_matmul(
            x,
            weight.shape[0],
            weight.shape[1] * 2,
            lambda r0, r1, dtype: dequantize_mxfp4(weight, scale, r0, r1, dtype),
        )

    def dequantize(self, layer):
        return dequantize_mxfp4(layer.weight, layer.scale)

    # -- stacked experts ---------------------------------------------------------------
    def create_expert_weights(self, module, num_experts, in_features, out_features, params_dtype):
        _check_shape(in_features, "MoE experts")
        module.weight = stored_param((num_experts, out_features, in_features // 2), torch.uint8)
        module.scale = stored_param((num_experts, out_features, in_features // GROUP), torch.uint8)

    def process_expert_weights_after_loading(self, module, prefix):
        check_expert_e8m0(module.scale, prefix, "scale", getattr(module, "device_ids", None))

    def expert_weight(self, module, expert, dtype):
        return dequantize_mxfp4(module.weight[expert], module.scale[expert], dtype=dtype)

    def apply_expert(self, module, expert, x):
        weight, scale = module.weight[expert], module.scale[expert]
        return tiled_matmul(
            x,
            weight.shape[0],
            weight.shape[1] * 2,
            lambda r0, r1, dtype: dequantize_mxfp4(weight, scale, r0, r1, dtype),
        )
