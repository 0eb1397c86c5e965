"""A linear layer: its weight storage comes from a `WeightFormat`, its matmul from the
device's linear ops (engine/ops/linear.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.ops.device_layer import DeviceLayer, DeviceSetup, build
from engine.ops.linear import TORCH_LINEAR, LinearOps
from engine.quant.base import QuantConfig
from engine.quant.unquantized import NoQuant


class Linear(nn.Module, DeviceLayer):
    """y = x W^T (+ b). `prefix` is the layer's checkpoint name without `.weight`, so the
    quant config can choose its format and the format can name its tensors."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        quant_config: QuantConfig | None = None,
        prefix: str = "",
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.prefix = prefix
        params_dtype = params_dtype or torch.get_default_dtype()
        self.format = (quant_config or NoQuant()).format_for(prefix, in_features, out_features)
        self.format.create_weights(self, in_features, out_features, params_dtype)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=params_dtype), requires_grad=False
            )
        else:
            self.bias = None
        self.ops: LinearOps = TORCH_LINEAR

    def prepare(self, setup: DeviceSetup) -> None:
        self.ops = build("linear", self, setup)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ops.forward(self, x)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def process_weights_after_loading(self) -> None:
        self.format.process_weights_after_loading(self)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.format.name}"
