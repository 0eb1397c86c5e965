"""Model loading: catalog aliases, Hugging Face safetensors directories and GGUF files,
all opened as a `ModelSource` that streams weights under Hugging Face names."""

from engine.loader.model_source import ModelSource, open_model_source

__all__ = ["ModelSource", "open_model_source"]
