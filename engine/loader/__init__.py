"""Model loading: catalog aliases, Hugging Face safetensors directories and GGUF files,
all opened as a `ModelSource` that streams weights under Hugging Face names.

The format modules are imported here so that each registers its opener with
`model_source` before anything opens a model (model_source never imports them)."""

from engine.loader import gguf_source, safetensors_source  # noqa: F401  (register formats)
from engine.loader.model_source import ModelSource, open_model_source

__all__ = ["ModelSource", "open_model_source"]
