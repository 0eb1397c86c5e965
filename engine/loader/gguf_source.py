"""GGUF files (llama architecture) through gguf-py's GGUFReader (a numpy memmap).

Three things differ from a Hugging Face checkpoint and are undone here:

- names: `blk.N.attn_q.weight` -> `model.layers.N.self_attn.q_proj.weight`, ...;
- shapes: GGUF lists dimensions fastest first, so a [out, in] weight shows as [in, out];
  the reader's arrays are already [out, in] (rows of blocks for quantized types);
- q_proj / k_proj rows: llama.cpp's converter reorders each head's rows from the
  Hugging Face rotary layout (first half, second half) to interleaved pairs; we apply
  the inverse. Rows are independent of the blocks within them, so the inverse works on
  raw quantized rows as well as on dequantized ones.

The config is built from the metadata with the keys transformers' LlamaConfig uses.

The `gguf` package is imported where a GGUF file is read: this module registers the format
on every start of the engine (engine/loader/__init__.py), and a safetensors model never
needs the package.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.loader.model_source import ModelSource, SourceFormat, register_format
from engine.quant.gguf import BLOCK_TYPES, FLOAT_TYPES, GGUFQuantConfig
from engine.quant.unquantized import NoQuant
from engine.tokenizer import Tokenizer
from kernels.cpu.gguf_blocks import dequantize_blocks

if TYPE_CHECKING:
    from gguf import GGUFReader

SUPPORTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face name; unknown names raise naming the tensor."""
    if m := _BLOCK_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF tensor 'rope_freqs.weight' (Llama 3 per-frequency rope factors) is not "
            "supported; use the Hugging Face checkpoint of this model"
        )
    raise ValueError(f"GGUF tensor {gguf_name!r} has no llama counterpart")


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k reordering: per head, rows (i, pair) -> (pair, i)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of pairs")
    per_half = rows // n_head // 2
    w = w.reshape(n_head, per_half, 2, *w.shape[1:]).transpose(1, 2)  # [h, 2, i, ...]
    return w.reshape(rows, *w.shape[3:]).contiguous()


def _field(reader: GGUFReader, key: str, default=None):
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None:
        return default
    if f.types and f.types[0] == GGUFValueType.ARRAY:
        return list(f.contents())
    return f.contents()


def config_from_metadata(reader: GGUFReader, path: Path) -> dict:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)}"
        )

    def meta(key: str, default=None, required: bool = False):
        value = _field(reader, f"{arch}.{key}", default)
        if required and value is None:
            raise ValueError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    tensor_names = {t.name for t in reader.tensors}
    hidden = int(meta("embedding_length", required=True))
    heads = int(meta("attention.head_count", required=True))
    vocab = meta("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"{path}: no {arch}.vocab_size and no tokenizer.ggml.tokens")
        vocab = len(tokens.data)
    head_dim = meta("attention.key_length") or meta("rope.dimension_count") or hidden // heads
    rope_theta = float(meta("rope.freq_base", 10000.0))
    rope: dict = {"rope_type": "default", "rope_theta": rope_theta}
    scaling_type = meta("rope.scaling.type")
    factor = meta("rope.scaling.factor")
    if scaling_type in ("linear", "yarn") and factor:
        rope = {"rope_type": scaling_type, "rope_theta": rope_theta, "factor": float(factor)}
        original = meta("rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
    elif scaling_type not in (None, "none"):
        raise ValueError(f"{path}: rope scaling type {scaling_type!r} is not supported")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length", required=True)),
        "num_hidden_layers": int(meta("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "rope_theta": rope_theta,
        "rope_parameters": rope,
        "rope_scaling": None if rope["rope_type"] == "default" else dict(rope),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": False,
    }
    for key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        value = _field(reader, gguf_key)
        config[key] = int(value) if value is not None else None
    return config


def _tensor_type(t) -> str:
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType(t.tensor_type).name


def _as_torch(t, qtype: str) -> torch.Tensor:
    """The tensor's stored data as torch, copied out of the memmap (one tensor at a time):
    float types as [out, in] floats, block types as raw uint8 [out, row bytes]."""
    data = np.array(t.data)  # copy: the memmap is read-only
    if qtype == "BF16":
        rows = torch.from_numpy(data.view(np.uint8)).view(torch.bfloat16)
        return rows.reshape([int(n) for n in reversed(t.shape)])
    tensor = torch.from_numpy(data)
    if qtype in FLOAT_TYPES:
        return tensor.reshape([int(n) for n in reversed(t.shape)])
    return tensor


def open_gguf_file(
    name: str, path: Path, dtype: torch.dtype | None, device: str | torch.device | None = None
) -> ModelSource:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # gguf-py raises ValueError / struct errors on bad files
        raise ValueError(f"cannot read GGUF file {path}: {exc}") from exc
    config = config_from_metadata(reader, path)
    tensor_types: dict[str, str] = {}
    for t in reader.tensors:
        qtype = _tensor_type(t)
        if qtype not in BLOCK_TYPES + FLOAT_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name!r} has GGUF type {qtype}, which is not supported "
                f"(supported: {', '.join(FLOAT_TYPES + BLOCK_TYPES)})"
            )
        tensor_types[hf_name(t.name)] = qtype

    keep_blocks = dtype is None
    # The embedding is always yielded dequantized: a lookup reads a few rows, and when
    # tied, the head multiplies by it in float (see GGUFQuantConfig on why heads stay float).
    quant_config = (
        GGUFQuantConfig(
            {
                n.removesuffix(".weight"): q
                for n, q in tensor_types.items()
                if q in BLOCK_TYPES and n != "model.embed_tokens.weight"
            },
            device,
        )
        if keep_blocks
        else NoQuant()
    )

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for t in reader.tensors:
            qtype = _tensor_type(t)
            name_hf = hf_name(t.name)
            tensor = _as_torch(t, qtype)
            is_embedding = name_hf == "model.embed_tokens.weight"
            if qtype in BLOCK_TYPES and (not keep_blocks or is_embedding):
                tensor = dequantize_blocks(tensor, qtype)
            elif qtype in FLOAT_TYPES and (dtype is not None or qtype == "F32"):
                tensor = tensor.float()
            if ".self_attn.q_proj." in name_hf:
                tensor = unpermute_rope_rows(tensor, heads)
            elif ".self_attn.k_proj." in name_hf:
                tensor = unpermute_rope_rows(tensor, kv_heads)
            if dtype is not None and tensor.is_floating_point():
                tensor = tensor.to(dtype)
            yield name_hf, tensor

    return ModelSource(
        name=name,
        path=path,
        config=config,
        quant_config=quant_config,
        weight_stream=stream,
        tokenizer_loader=lambda: Tokenizer.from_gguf(path),
        format="gguf",
    )


register_format(SourceFormat(name="gguf", title="GGUF", opener=open_gguf_file, suffix=".gguf"))
