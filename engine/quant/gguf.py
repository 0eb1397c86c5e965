"""GGUF block formats (Q8_0, Q4_0, Q4_1) as weight formats of `Linear` layers.

Loading: the layer registers `<prefix>.weight` as the file's raw blocks, uint8 [out, row
bytes], so the loader's tensors copy in by name with no conversion. After loading, the
blocks are decoded once and repacked for torch's int4 CPU kernel
(kernels/cpu/quant_matmul.py): Q4_0 and Q4_1 map onto it exactly (w = d q + m becomes
(q - 8) s + z with s = d, z = m + 8 d), Q8_0 becomes two nibble halves over the doubled
input [x, x]. The weight then takes ~0.56 bytes per value (Q4) or ~1.1 (Q8_0) instead of
4 in float32, which is what makes CPU decode fast: at batch 1 a step reads every weight
once, so time per token is about weight bytes / memory bandwidth.

Where that kernel cannot run (not a CPU device, an older torch, out_features not a
multiple of 16 as in tiny test models) the format decodes to a dense weight of the
model's dtype instead: correct, just not small.

The output head stays float (dense, the model's dtype), quantized or not: the int4
kernel returns bfloat16, whose spacing at a logit of 25 is 0.125, while the top two
logits of SmolLM2 on a plain chat prompt differ by 0.08 (measured: "The" 25.33 vs "L"
25.24). bfloat16 logits flip greedy choices and coarsen sampling; inner layers' bfloat16
outputs are as harmless as in any bf16 inference. The GGUF loader yields the embedding
dequantized (a lookup reads a few rows); a tied head multiplies by that same tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quant.base import QuantConfig, WeightFormat
from engine.quant.unquantized import Unquantized
from kernels.cpu import batch_invariant
from kernels.cpu.gguf_blocks import dequantize_blocks, row_bytes, split_q4, split_q8_0
from kernels.cpu.quant_matmul import (
    Int4Weight,
    int4_dequantize,
    int4_kernel_available,
    int4_matmul,
    int8_groups_as_int4,
)

BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1")
FLOAT_TYPES = ("F32", "F16", "BF16")


class GGUFBlockFormat(WeightFormat):
    """A linear weight stored as GGUF blocks of one type (Q8_0, Q4_0 or Q4_1)."""

    def __init__(self, qtype: str, packed_kernel: bool = True) -> None:
        if qtype not in BLOCK_TYPES:
            raise ValueError(f"GGUF block format must be one of {BLOCK_TYPES}, got {qtype}")
        self.qtype = qtype
        self.name = f"gguf-{qtype.lower()}"
        self.packed_kernel = packed_kernel

    def create_weights(self, layer, in_features, out_features, params_dtype):
        nbytes = row_bytes(self.qtype, in_features)
        layer.weight = nn.Parameter(
            torch.empty(out_features, nbytes, dtype=torch.uint8), requires_grad=False
        )
        layer.dense_dtype = params_dtype
        layer.int4 = None

    def process_weights_after_loading(self, layer):
        raw = layer.weight.data  # [N, row bytes]
        packed = None
        if self.packed_kernel and raw.device.type == "cpu" and int4_kernel_available():
            try:
                packed = self._pack(raw)
            except ValueError:
                packed = None  # shape the kernel cannot take: dense fallback below
        del layer.weight
        if packed is not None:
            layer.int4 = packed
            self.name = f"gguf-{self.qtype.lower()}-int4pack"
        else:
            dense = dequantize_blocks(raw, self.qtype).to(layer.dense_dtype)
            layer.weight = nn.Parameter(dense, requires_grad=False)
            self.name = f"gguf-{self.qtype.lower()}-dense"

    def _pack(self, raw: torch.Tensor) -> Int4Weight:
        if self.qtype == "Q8_0":
            q, d = split_q8_0(raw)  # [N, G, 32], [N, G]
            q4, scale, zero = int8_groups_as_int4(q, d)
            return Int4Weight.pack(q4, scale, zero)
        q, d, m = split_q4(raw, self.qtype)  # [N, G, 32], [N, G], [N, G]
        n = q.shape[0]
        return Int4Weight.pack(q.reshape(n, -1), d, m + 8.0 * d)

    def apply(self, layer, x):
        if layer.int4 is None:
            if "weight" in layer._parameters and layer.weight.dtype == torch.uint8:
                raise RuntimeError(
                    f"{layer.prefix}: GGUF weights used before process_weights_after_loading"
                )
            return batch_invariant.linear(x.to(layer.weight.dtype), layer.weight).to(x.dtype)
        if self.qtype == "Q8_0":
            x = torch.cat([x, x], dim=-1)  # the hi and lo nibble halves share x
        return int4_matmul(x, layer.int4)

    def dequantize(self, layer):
        if layer.int4 is not None:
            w = int4_dequantize(layer.int4)  # [N, K] or [N, 2K] for Q8_0
            if self.qtype == "Q8_0":
                hi, lo = w.chunk(2, dim=1)
                w = hi + lo
            return w
        if layer.weight.dtype == torch.uint8:
            return dequantize_blocks(layer.weight.data, self.qtype)
        return layer.weight.float()


class GGUFQuantConfig(QuantConfig):
    """Each linear layer's format from the GGUF file: `tensor_types` maps a layer prefix
    (Hugging Face name without `.weight`) to its GGUF type name; float types and layers
    not listed are plain float weights."""

    def __init__(self, tensor_types: dict[str, str], device: str | torch.device | None = None):
        unknown = {p: t for p, t in tensor_types.items() if t not in BLOCK_TYPES + FLOAT_TYPES}
        if unknown:
            raise ValueError(f"GGUF tensor types without a weight format: {unknown}")
        self.tensor_types = dict(tensor_types)
        self.device = torch.device(device) if device is not None else None

    def format_for(self, prefix, in_features, out_features):
        qtype = self.tensor_types.get(prefix)
        if qtype in BLOCK_TYPES:
            on_cpu = self.device is None or self.device.type == "cpu"
            # logits need more than bfloat16 precision (module docstring)
            return GGUFBlockFormat(qtype, packed_kernel=on_cpu and prefix != "lm_head")
        return Unquantized()

    def __repr__(self) -> str:
        counts: dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[t] = counts.get(t, 0) + 1
        return f"GGUFQuantConfig({counts})"
