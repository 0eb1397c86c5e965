"""Model loading: catalog aliases, Hugging Face safetensors directories, GGUF files and
`random:` specs (random weights made in memory), all opened as a `ModelSource` that
streams weights under their checkpoint's names.

The format and scheme modules are imported here so that each registers its opener with
`model_source` before anything opens a model (model_source never imports them)."""

from engine.loader import (  # noqa: F401  (register formats and schemes)
    gguf_source,
    random_source,
    safetensors_source,
)
from engine.loader.model_source import ModelSource, open_model_source

__all__ = ["ModelSource", "open_model_source"]
