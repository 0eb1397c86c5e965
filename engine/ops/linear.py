"""A linear layer's matmul: the interface and its torch implementation, which is the
weight format's own (engine/quant/: every format computes y = x W^T from what it stores)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from engine.ops.device_layer import DeviceSetup, register


class LinearOps(ABC):
    @abstractmethod
    def forward(self, linear, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] @ W^T -> [..., out] in x's dtype, without the bias."""


class TorchLinearOps(LinearOps):
    def forward(self, linear, x):
        return linear.format.apply(linear, x)


TORCH_LINEAR = TorchLinearOps()


@register("linear", "cpu")
def torch_linear_ops(linear, setup: DeviceSetup) -> LinearOps:
    return TORCH_LINEAR
