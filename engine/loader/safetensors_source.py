"""Hugging Face directories: config.json plus one *.safetensors file or shards listed in
model.safetensors.index.json. Tensors are read one at a time through `safe_open` (mmap)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.loader.model_source import ModelSource, SourceFormat, register_format
from engine.loader.quant_methods import quant_config_from_hf
from engine.tokenizer import Tokenizer

INDEX_NAME = "model.safetensors.index.json"
# Stored floating dtypes an explicit dtype converts; others (fp8, packed uint8, int
# scales) are quantized storage and pass through as stored.
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise OSError(f"cannot read {path}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def shard_plan(directory: Path) -> dict[Path, list[str] | None]:
    """Files to read, each with the tensor names the index promises in it (None: no
    index, take whatever the file holds)."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        plan: dict[Path, list[str]] = {}
        for tensor_name, file_name in weight_map.items():
            plan.setdefault(directory / file_name, []).append(tensor_name)
        missing = [str(p) for p in plan if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} names shard files that do not exist: {missing}")
        return dict(plan)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{directory} has config.json but no *.safetensors weights "
            "(pytorch_model.bin checkpoints are not supported; re-save with safetensors)"
        )
    return dict.fromkeys(files)


def iter_safetensors(
    plan: dict[Path, list[str] | None], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    for file, promised in plan.items():
        try:
            handle = safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise OSError(f"cannot read safetensors file {file}: {exc}") from exc
        with handle as f:
            present = set(f.keys())
            if promised is not None:
                absent = [n for n in promised if n not in present]
                if absent:
                    raise ValueError(
                        f"{file.name}: tensors named in {INDEX_NAME} are missing from the "
                        f"shard: {absent[:20]}"
                    )
            for name in sorted(present):
                tensor = f.get_tensor(name)
                if dtype is not None and tensor.dtype in _FLOAT_DTYPES:
                    tensor = tensor.to(dtype)
                yield name, tensor


def open_safetensors_dir(name: str, directory: Path, dtype: torch.dtype | None) -> ModelSource:
    config_path = directory / "config.json"
    config = read_json(config_path)
    quant_config = quant_config_from_hf(config, str(config_path))
    plan = shard_plan(directory)
    return ModelSource(
        name=name,
        path=directory,
        config=config,
        quant_config=quant_config,
        weight_stream=lambda: iter_safetensors(plan, dtype),
        tokenizer_loader=lambda: Tokenizer.from_dir(directory),
        format="safetensors",
    )


register_format(
    SourceFormat(
        name="safetensors",
        title="Hugging Face",
        opener=lambda name, path, dtype, device: open_safetensors_dir(name, path, dtype),
        marker="config.json",
    )
)
