"""Which format each DeepSeek weight is stored in, read from config.json.

Keys understood (config.json):
- `quantization_config`: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
  means dense linear layers are FP8 with float32 `weight_scale_inv` (DeepSeek-V3). With
  `"scale_fmt": "ue8m0"` the block scales are E8M0 tensors named `scale` (DeepSeek-V4).
  `modules_to_not_convert` / `ignored_layers` list name fragments kept in bf16.
- `expert_dtype` ("bf16" | "fp8" | "fp4"), at the top level as in DeepSeek-V4's inference
  config or inside `quantization_config`: the routed experts' format. "fp4" is MXFP4
  (`weight` uint8 [out, in/2] + `scale` E8M0 [out, in/32]). Without the key, experts follow
  the dense format.
The LM head, the MTP head (`shared_head.head`) and the MTP input projection (`eh_proj`)
stay unquantized unless `quantized_prefixes` (the checkpoint's own list, from its tensor
names) says otherwise; the router and the norms are never Linear layers here.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.quant.base import QuantConfig, WeightFormat
from engine.quant.expert_format import ExpertWeightFormat, UnquantizedExperts
from engine.quant.fp8_block import Fp8BlockFormat
from engine.quant.mxfp4 import Mxfp4Format
from engine.quant.unquantized import Unquantized

EXPERT_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8", "fp4": "fp4", "mxfp4": "fp4"}
NEVER_QUANTIZED_BY_DEFAULT = ("lm_head", "shared_head.head", "eh_proj")


class DeepseekQuantConfig(QuantConfig):
    def __init__(
        self,
        dense: str = "bf16",
        experts: str | None = None,
        fp8_scale_format: str = "float32",
        not_converted: Iterable[str] = (),
        quantized_prefixes: set[str] | None = None,
    ) -> None:
        if dense not in ("bf16", "fp8"):
            raise ValueError(f"dense weight format must be 'bf16' or 'fp8', got {dense!r}")
        experts = dense if experts is None else experts
        if experts not in ("bf16", "fp8", "fp4"):
            raise ValueError(f"expert format must be 'bf16', 'fp8' or 'fp4', got {experts!r}")
        self.dense, self.experts = dense, experts
        self.fp8_scale_format = fp8_scale_format
        self.not_converted = tuple(not_converted)
        self.quantized_prefixes = quantized_prefixes

    def _dense_is_fp8(self, prefix: str) -> bool:
        if self.dense != "fp8":
            return False
        if self.quantized_prefixes is not None:
            return prefix in self.quantized_prefixes
        excluded = NEVER_QUANTIZED_BY_DEFAULT + self.not_converted
        return not any(prefix == e or prefix.endswith("." + e) or e in prefix for e in excluded)

    def format_for(self, prefix: str, in_features: int, out_features: int) -> WeightFormat:
        if self._dense_is_fp8(prefix):
            return Fp8BlockFormat(self.fp8_scale_format)
        return Unquantized()

    def expert_format_for(
        self, prefix: str, in_features: int, out_features: int
    ) -> ExpertWeightFormat:
        if self.experts == "fp8":
            return Fp8BlockFormat(self.fp8_scale_format)
        if self.experts == "fp4":
            return Mxfp4Format()
        return UnquantizedExperts()

    @classmethod
    def from_config(
        cls, config: dict, tensor_names: Iterable[str] | None = None
    ) -> DeepseekQuantConfig | None:
        """None when the checkpoint is plain float. `tensor_names` (the checkpoint's index),
        when given, decides exactly which dense linears are FP8: those with a scale tensor."""
        qc = dict(config.get("quantization_config") or {})
        expert_key = qc.get("expert_dtype", config.get("expert_dtype"))
        if not qc and expert_key is None:
            return None
        dense = "bf16"
        if qc:
            method = qc.get("quant_method")
            if method != "fp8":
                raise ValueError(
                    f"config.json quantization_config.quant_method {method!r} is not supported "
                    "for deepseek models (supported: 'fp8', plus 'expert_dtype': 'fp4')"
                )
            fmt = qc.get("fmt", "e4m3")
            if fmt != "e4m3":
                raise ValueError(f"config.json quantization_config.fmt {fmt!r}: only e4m3")
            block = qc.get("weight_block_size") or [128, 128]
            if list(block) != [128, 128]:
                raise ValueError(
                    f"config.json quantization_config.weight_block_size {block}: only [128, 128]"
                )
            dense = "fp8"
        experts = None
        if expert_key is not None:
            if str(expert_key).lower() not in EXPERT_DTYPES:
                raise ValueError(
                    f"config.json expert_dtype {expert_key!r}: expected one of "
                    f"{sorted(set(EXPERT_DTYPES))}"
                )
            experts = EXPERT_DTYPES[str(expert_key).lower()]
        scale_fmt = "e8m0" if qc.get("scale_fmt") in ("ue8m0", "e8m0") else "float32"
        not_converted = list(qc.get("modules_to_not_convert") or []) + list(
            qc.get("ignored_layers") or []
        )
        quantized = None
        if tensor_names is not None:
            suffix = ".weight_scale_inv" if scale_fmt == "float32" else ".scale"
            quantized = {n[: -len(suffix)] for n in tensor_names if n.endswith(suffix)}
        return cls(dense, experts, scale_fmt, not_converted, quantized)


def from_quantization_config(quantization_config: dict) -> DeepseekQuantConfig:
    """The loader's registry hook (engine/loader/quant_methods.py, quant_method "fp8"):
    built from the `quantization_config` block alone (an `expert_dtype` inside it counts)."""
    made = DeepseekQuantConfig.from_config({"quantization_config": quantization_config})
    assert made is not None  # a non-empty quantization_config always yields a config
    return made
