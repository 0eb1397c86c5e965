"""Shared fixtures: the bundled MiniLM model (loaded once) and the mixed-task set's
embeddings (embedded once per session: ~600 short prompts)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from clustering.embed import Embedder
from tests.clustering.mixed_tasks import mixed_tasks


@pytest.fixture(scope="session")
def embedder() -> Embedder:
    return Embedder(device="cpu")


@pytest.fixture(scope="session")
def mixed_frame():
    return mixed_tasks()


@pytest.fixture(scope="session")
def mixed_vectors(embedder, mixed_frame) -> np.ndarray:
    return embedder.embed(mixed_frame["prompt"].to_list())


class HashEmbedder:
    """A stand-in for Embedder where the test is about caching, not meaning: each text maps
    to a fixed pseudo-random unit vector, and every text sent to it is counted."""

    def __init__(self, dim: int = 8, fingerprint: str = "hash-embedder"):
        self.dim = dim
        self.fingerprint = fingerprint
        self.texts_embedded = 0
        self.calls: list[list[str]] = []

    def embed(self, texts):
        self.calls.append(list(texts))
        self.texts_embedded += len(texts)
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, text in enumerate(texts):
            seed = int.from_bytes(hashlib.sha1(text.encode()).digest()[:4], "little")
            v = np.random.default_rng(seed).standard_normal(self.dim)
            out[i] = v / np.linalg.norm(v)
        return out
