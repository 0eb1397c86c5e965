"""A model on disk, opened: its config, weight formats, tokenizer and a weight stream.

`open_model_source` accepts a catalog alias, a Hugging Face directory (config.json plus
*.safetensors, tokenizer files optional) or a GGUF file (or a directory holding exactly
one). Weights are streamed one tensor at a time under Hugging Face names; the model's
`load_weights` copies each into place, so no checkpoint is ever held twice in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from engine.quant.base import QuantConfig
from engine.tokenizer import Tokenizer


@dataclass
class ModelSource:
    name: str  # what the user asked for (alias or path)
    path: Path  # the resolved file or directory
    config: dict  # Hugging Face config.json keys
    quant_config: QuantConfig
    weight_stream: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    tokenizer_loader: Callable[[], Tokenizer | None] = field(repr=False)
    format: str = "safetensors"  # "safetensors" | "gguf"

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every tensor of the checkpoint, one at a time."""
        return self.weight_stream()

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """Loaded on first use (a GGUF vocabulary takes seconds to convert)."""
        return self.tokenizer_loader()

    @property
    def declared_context(self) -> int | None:
        """The context length the config declares (config.json's max_position_embeddings,
        a GGUF file's context_length), known without building the model; None when the
        config leaves it to the model family's default."""
        value = self.config.get("max_position_embeddings")
        return int(value) if value is not None else None


def open_model_source(
    model: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> ModelSource:
    """Open `model` for loading.

    dtype None ("auto") keeps quantized weights in their stored form (GGUF blocks become
    small CPU kernels); an explicit dtype dequantizes GGUF weights to it (float32: exact,
    for parity tests). `device` tells the GGUF formats whether the CPU kernels apply.
    """
    from engine.loader.catalog import is_alias, resolve_model

    name = str(model)
    path = resolve_model(name) if is_alias(name) else Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {name!r}: no such file or directory, and not a known model alias "
            "(see `batchgen models list`)"
        )
    if path.is_dir():
        if (path / "config.json").is_file():
            from engine.loader.safetensors_source import open_safetensors_dir

            return open_safetensors_dir(name, path, dtype)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) > 1:
            listed = ", ".join(p.name for p in ggufs)
            raise ValueError(f"{path} holds several GGUF files ({listed}); pass one of them")
        if not ggufs:
            raise FileNotFoundError(
                f"{path} has no config.json (Hugging Face layout) and no .gguf file"
            )
        path = ggufs[0]
    if path.suffix.lower() != ".gguf":
        raise ValueError(
            f"{path}: a model file must be GGUF (.gguf); for safetensors pass the directory "
            "holding config.json"
        )
    from engine.loader.gguf_source import open_gguf_file

    return open_gguf_file(name, path, dtype, device)
