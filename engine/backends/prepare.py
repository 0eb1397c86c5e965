"""Preparing a loaded model for its device: every `DeviceLayer` takes its layer type's
ops for that device from the registry, once (engine/ops/device_layer.py)."""

from __future__ import annotations

import importlib
import logging
from collections import Counter

from torch import nn

from engine.ops.device_layer import DeviceLayer, DeviceSetup

log = logging.getLogger(__name__)

# Device types with their own backend package (engine/backends/<type>); every other
# device runs the torch ops registered for "cpu".
BACKEND_PACKAGES = {"cuda": "engine.backends.cuda"}


def prepare_model(model: nn.Module, setup: DeviceSetup) -> None:
    package = BACKEND_PACKAGES.get(setup.device.type)
    if package is not None:
        importlib.import_module(package)  # its modules register their ops
    chosen: Counter[str] = Counter()
    for module in model.modules():
        if isinstance(module, DeviceLayer):
            module.prepare(setup)
            chosen[type(module.ops).__name__] += 1
    log.info("prepared for %s: %s", setup.device.type, dict(sorted(chosen.items())))
