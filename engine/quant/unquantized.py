"""Plain float weights (fp32 / bf16 / fp16), stored as `weight` [out, in]."""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.base import QuantConfig, WeightFormat
from kernels.cpu import batch_invariant


class Unquantized(WeightFormat):
    name = "unquantized"

    def create_weights(self, layer, in_features, out_features, params_dtype):
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=params_dtype), requires_grad=False
        )

    def apply(self, layer, x):
        return batch_invariant.linear(x.to(layer.weight.dtype), layer.weight).to(x.dtype)

    def dequantize(self, layer):
        return layer.weight.float()


class NoQuant(QuantConfig):
    def format_for(self, prefix, in_features, out_features):
        return Unquantized()
