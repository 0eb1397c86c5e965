"""How a layer gets the implementation of its arithmetic for the device it runs on.

A `DeviceLayer` holds its parameters and delegates its forward to `self.ops`, an object
implementing the layer type's interface (engine/ops/<type>.py). The torch implementation
(the CPU's, and the fallback on every device) is the default from construction. When the
model is prepared for a device (engine/backends/prepare.py), each layer asks the
registry once for its type's implementation on that device:

    register("moe", "cuda")(CudaMoeOps)        # in the backend's module
    self.ops = build("moe", self, setup)       # in DeepseekMoE.prepare

A factory takes the layer and the `DeviceSetup` and returns the ops object, which keeps
whatever device state it derives (stacked weights, rope tables, streams) to itself: nothing
is set on the layer from outside. Layers never import a backend and backends never import
layers; both import this package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.config import CudaTuning


@dataclass
class DeviceSetup:
    """What the backends need to prepare a model for one device."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    tuning: CudaTuning = field(default_factory=CudaTuning)
    # A row's arithmetic independent of its batch (docs/batch-invariance.md).
    batch_invariant: bool = True
    # Objects one model's layers share (a CUDA side stream): made once per preparation.
    _shared: dict[str, Any] = field(default_factory=dict, repr=False)

    def shared(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]


Factory = Callable[[Any, DeviceSetup], Any]
_FACTORIES: dict[tuple[str, str], Factory] = {}


def register(kind: str, device_type: str) -> Callable[[Factory], Factory]:
    """Decorator: `factory(layer, setup)` builds layer type `kind`'s ops on `device_type`."""

    def add(factory: Factory) -> Factory:
        key = (kind, device_type)
        if key in _FACTORIES and _FACTORIES[key] is not factory:
            raise ValueError(f"{kind!r} ops for {device_type!r} registered twice")
        _FACTORIES[key] = factory
        return factory

    return add


def build(kind: str, layer: Any, setup: DeviceSetup) -> Any:
    """The ops for `layer` (of type `kind`) on setup.device: the device's own implementation
    where one is registered, else the torch one (registered for "cpu")."""
    factory = _FACTORIES.get((kind, setup.device.type)) or _FACTORIES.get((kind, "cpu"))
    if factory is None:
        raise KeyError(f"no {kind!r} ops registered for {setup.device.type!r} or 'cpu'")
    return factory(layer, setup)


class DeviceLayer(ABC):
    """A layer whose arithmetic depends on the device (engine/backends/prepare.py calls
    `prepare` on every one of a model's DeviceLayers, children before parents)."""

    @abstractmethod
    def prepare(self, setup: DeviceSetup) -> None:
        """Take this layer type's ops for setup.device (`self.ops = build(...)`)."""
