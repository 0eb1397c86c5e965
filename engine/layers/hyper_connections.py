"""DeepSeek-V4's hyper-connections (mHC): the C-stream residual's mixing around a sublayer,
and the head's collapse. The arithmetic is the device's ops (engine/ops/hyper_connections.py;
legend: docs/shapes.md, T tokens, C streams = `hc_mult`, D hidden).

Parameters are float32 (the hub stores them so, and the mixing is computed in float32) and
carry the hub's names: a layer's attention mix holds `hc_attn_fn` [(2 + C) * C, C * D],
`hc_attn_base` [(2 + C) * C] and `hc_attn_scale` [3] (`hc_ffn_*` for the FFN's); the head
holds `hc_head_fn` [C, C * D], `hc_head_base` [C], `hc_head_scale` [1]. `prefix` is the
owner's checkpoint prefix ("layers.3.", "mtp.0.", "" for the model's head), so
`checkpoint_tensors()` names every parameter as the hub checkpoint does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.ops.device_layer import DeviceLayer, DeviceSetup, build
from engine.ops.hyper_connections import (
    TORCH_HYPER_CONNECTION,
    TORCH_HYPER_HEAD,
    HyperConnectionOps,
    HyperHeadOps,
)


class _HyperParams(nn.Module):
    """fn / base / scale registered as `{name}_fn`, `{name}_base`, `{name}_scale`."""

    def __init__(self, name: str, prefix: str, rows: int, cols: int, scales: int) -> None:
        super().__init__()
        self.name, self.prefix = name, prefix
        for leaf, shape in (("fn", (rows, cols)), ("base", (rows,)), ("scale", (scales,))):
            param = nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False)
            self.register_parameter(f"{name}_{leaf}", param)

    @property
    def fn(self) -> torch.Tensor:
        return getattr(self, f"{self.name}_fn")

    @property
    def base(self) -> torch.Tensor:
        return getattr(self, f"{self.name}_base")

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, f"{self.name}_scale")

    def checkpoint_tensors(self) -> dict[str, nn.Parameter]:
        """Hub checkpoint name -> parameter ("layers.3.hc_attn_fn", ...)."""
        return {f"{self.prefix}{n}": p for n, p in self.named_parameters(recurse=False)}


class HyperConnection(_HyperParams, DeviceLayer):
    """The mixing around one sublayer: `pre` reduces the C streams to the sublayer's input,
    `post` writes its output back into C new streams."""

    def __init__(
        self,
        hidden_size: int,
        hc_mult: int,
        hc_sinkhorn_iters: int,
        hc_eps: float,
        norm_eps: float,
        name: str,
        prefix: str = "",
    ) -> None:
        mix = (2 + hc_mult) * hc_mult  # pre C, post C, comb C*C
        super().__init__(name, prefix, mix, hc_mult * hidden_size, 3)
        self.hc_mult = hc_mult
        self.hc_sinkhorn_iters = hc_sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps  # the unweighted RMSNorm of the flattened streams
        self.ops: HyperConnectionOps = TORCH_HYPER_CONNECTION

    def prepare(self, setup: DeviceSetup) -> None:
        self.ops = build("hyper_connection", self, setup)

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, C, D] -> (x [T, D], post [T, C] float32, comb [T, C, C] float32)."""
        return self.ops.pre(self, streams)

    def post(
        self, y: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """y [T, D], streams [T, C, D] (the ones `pre` read) -> the next streams [T, C, D]."""
        return self.ops.post(self, y, streams, post, comb)

    def forward(
        self, streams: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """streams [T, C, D] -> streams [T, C, D] after `sublayer` ([T, D] -> [T, D])."""
        x, post, comb = self.pre(streams)
        return self.post(sublayer(x), streams, post, comb)

    def extra_repr(self) -> str:
        return f"{self.prefix}{self.name}, streams={self.hc_mult}"


class HyperHead(_HyperParams, DeviceLayer):
    """The head's collapse of the C streams into one [T, D] (its own pre weights; no comb)."""

    def __init__(
        self,
        hidden_size: int,
        hc_mult: int,
        hc_eps: float,
        norm_eps: float,
        name: str = "hc_head",
        prefix: str = "",
    ) -> None:
        super().__init__(name, prefix, hc_mult, hc_mult * hidden_size, 1)
        self.hc_mult = hc_mult
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.ops: HyperHeadOps = TORCH_HYPER_HEAD

    def prepare(self, setup: DeviceSetup) -> None:
        self.ops = build("hyper_head", self, setup)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, C, D] -> [T, D] in streams' dtype."""
        return self.ops.forward(self, streams)

    def extra_repr(self) -> str:
        return f"{self.prefix}{self.name}, streams={self.hc_mult}"
