"""Weight formats: how a linear layer stores its weight and multiplies by it.

A format creates the layer's parameters under the checkpoint's own names (so loading is
a plain copy by name), may repack them once after loading for the device it runs on, and
computes y = x W^T. Formats are picked per layer by a `QuantConfig` the checkpoint
provides (FP8 block-scaled, MXFP4, GGUF block types, ...), so CPU and GPU backends plug
into the same layer classes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from engine.quant.expert_format import ExpertWeightFormat, UnquantizedExperts


class WeightFormat(ABC):
    name: str = "abstract"

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, params_dtype: torch.dtype
    ) -> None:
        """Register the stored tensors on `layer` (as parameters or buffers)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack once after loading (e.g. into a kernel's preferred layout)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """y = x @ W^T for x [..., in_features], returning [..., out_features] in x's dtype."""

    @abstractmethod
    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        """The weight as a float32 tensor [out, in] (references and tests)."""


class QuantConfig(ABC):
    """Chooses each linear layer's format from the checkpoint's description."""

    @abstractmethod
    def format_for(self, prefix: str, in_features: int, out_features: int) -> WeightFormat: ...

    def expert_format_for(
        self, prefix: str, in_features: int, out_features: int
    ) -> ExpertWeightFormat:
        """The stacked experts' format (an ExpertWeightFormat) of one expert projection;
        plain weights unless the checkpoint quantizes its experts."""
        return UnquantizedExperts()
