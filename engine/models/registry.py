"""Model families by architecture name, with lazy imports (one module per family)."""

from __future__ import annotations

import importlib

# architecture or model_type name -> "module:Class"
_FAMILIES: dict[str, str] = {
    "llama": "engine.models.llama:LlamaForCausalLM",
    "LlamaForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "qwen2": "engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "mistral": "engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "engine.models.llama:LlamaForCausalLM",
    "deepseek_v3": "engine.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV3ForCausalLM": "engine.models.deepseek_v3:DeepseekV3ForCausalLM",
    "deepseek_v2": "engine.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM": "engine.models.deepseek_v3:DeepseekV3ForCausalLM",
    "deepseek_v4": "engine.models.deepseek_v4:DeepseekV4ForCausalLM",
    "DeepseekV4ForCausalLM": "engine.models.deepseek_v4:DeepseekV4ForCausalLM",
}


def model_class_for(config: dict) -> type:
    """Pick the family from a config.json dict: `architectures` first, then `model_type`."""
    candidates = list(config.get("architectures") or []) + [config.get("model_type")]
    for name in candidates:
        if name in _FAMILIES:
            module_name, cls_name = _FAMILIES[name].split(":")
            return getattr(importlib.import_module(module_name), cls_name)
    known = sorted({k for k in _FAMILIES if k[0].islower()})
    raise ValueError(
        f"unsupported model architecture {candidates!r}; supported model types: {known}"
    )
