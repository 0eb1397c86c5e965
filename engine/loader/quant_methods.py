"""Which `QuantConfig` a Hugging Face checkpoint's `quantization_config` asks for.

Keyed by `quant_method` (e.g. "fp8", "mxfp4"), with lazy "module:callable" targets so the
formats' own packages are imported only when a checkpoint uses them. A target is called
with the `quantization_config` dict and returns a QuantConfig. Formats added later
register here (`register_quant_method`) instead of editing the loader.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from engine.quant.base import QuantConfig
from engine.quant.unquantized import NoQuant

_METHODS: dict[str, str | Callable[[dict], QuantConfig]] = {
    "fp8": "engine.quant.deepseek_quant_config:from_quantization_config",
}


def register_quant_method(name: str, target: str | Callable[[dict], QuantConfig]) -> None:
    _METHODS[name] = target


def quant_config_from_hf(config: dict, config_path: str = "config.json") -> QuantConfig:
    qcfg = config.get("quantization_config")
    if not qcfg:
        return NoQuant()
    method = qcfg.get("quant_method")
    target = _METHODS.get(method)
    if target is None:
        raise ValueError(
            f"{config_path}: quantization_config.quant_method {method!r} is not supported; "
            f"supported: {sorted(_METHODS) or 'none yet'}"
        )
    if isinstance(target, str):
        module_name, attr = target.split(":")
        target = getattr(importlib.import_module(module_name), attr)
    return target(qcfg)
