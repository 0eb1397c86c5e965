"""An on-disk embedding cache keyed by text hash, so a resumed run embeds nothing again.

Layout (one sub-directory per embedding model, so vectors of two models never mix):

    <directory>/<model fingerprint>/shard-000001.vecs.npy   (n, dim) float32
    <directory>/<model fingerprint>/shard-000001.keys.npy   (n,) S16 BLAKE2b text digests

A shard is committed when its keys file exists: vectors are written first, each file as
tmp -> fsync -> rename, so a kill -9 leaves either a whole shard or an ignored orphan.
Vectors are memory-mapped, and the in-memory index holds 24 bytes a row (key, shard, row),
so a cache of millions of prompts costs tens of MB of RAM, not gigabytes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from clustering.embed import Embedder, text_keys

_SHARD = re.compile(r"^shard-(\d{6})\.(keys|vecs)\.npy$")
# Texts handed to the model per call: a few of its batches, a few seconds on 2 CPU cores,
# which is how often progress can move while one chunk is being embedded.
EMBED_SLICE = 512


def _save_atomic(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EmbeddingCache:
    """Append-only store of (text key -> vector) for one embedding model."""

    def __init__(self, directory: str | os.PathLike, model_fingerprint: str) -> None:
        self.directory = Path(directory) / model_fingerprint
        self.directory.mkdir(parents=True, exist_ok=True)
        self._vectors: list[np.ndarray] = []  # one memory map per shard, in shard order
        self._shard_numbers: list[int] = []
        self._keys = np.zeros(0, dtype="S16")  # sorted
        self._shard = np.zeros(0, dtype=np.int32)  # index into self._vectors, by sorted key
        self._row = np.zeros(0, dtype=np.int32)
        self._next_shard = 1
        self._open()

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def dim(self) -> int | None:
        return self._vectors[0].shape[1] if self._vectors else None

    def _open(self) -> None:
        committed: list[int] = []
        highest = 0
        for entry in os.listdir(self.directory):
            match = _SHARD.match(entry)
            if match is None:
                if entry.endswith(".tmp"):
                    # A write cut short by a crash; the shard it belonged to never committed.
                    (self.directory / entry).unlink(missing_ok=True)
                continue
            number = int(match.group(1))
            highest = max(highest, number)
            if match.group(2) == "keys":
                committed.append(number)
        self._next_shard = highest + 1
        keys_parts, shard_parts, row_parts = [], [], []
        for number in sorted(committed):
            keys = np.load(self._path(number, "keys"))
            vectors = np.load(self._path(number, "vecs"), mmap_mode="r")
            if vectors.shape[0] != keys.shape[0]:
                raise ValueError(
                    f"embedding cache shard {self._path(number, 'vecs')} holds {vectors.shape[0]} "
                    f"vectors for {keys.shape[0]} keys; delete the directory {self.directory}"
                )
            keys_parts.append(keys)
            shard_parts.append(np.full(len(keys), len(self._vectors), dtype=np.int32))
            row_parts.append(np.arange(len(keys), dtype=np.int32))
            self._vectors.append(vectors)
            self._shard_numbers.append(number)
        if keys_parts:
            keys = np.concatenate(keys_parts)
            order = np.argsort(keys, kind="stable")
            self._keys = keys[order]
            self._shard = np.concatenate(shard_parts)[order]
            self._row = np.concatenate(row_parts)[order]

    def _path(self, number: int, kind: str) -> Path:
        return self.directory / f"shard-{number:06d}.{kind}.npy"

    def _locate(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(found mask, index into the sorted key arrays) for each key."""
        if len(self._keys) == 0:
            return np.zeros(len(keys), dtype=bool), np.zeros(len(keys), dtype=np.int64)
        pos = np.searchsorted(self._keys, keys)
        clipped = np.minimum(pos, len(self._keys) - 1)
        return self._keys[clipped] == keys, clipped

    def contains(self, keys: np.ndarray) -> np.ndarray:
        return self._locate(keys)[0]

    def get(self, keys: np.ndarray) -> np.ndarray:
        """Vectors for keys that are all in the cache, (n, dim) float32 in key order."""
        found, index = self._locate(keys)
        if not found.all():
            raise KeyError(f"{int((~found).sum())} of {len(keys)} keys are not in the cache")
        out = np.empty((len(keys), self.dim or 0), dtype=np.float32)
        shards = self._shard[index]
        rows = self._row[index]
        for shard in np.unique(shards):
            mask = shards == shard
            out[mask] = self._vectors[shard][rows[mask]]
        return out

    def add(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Commit one shard of new (key, vector) pairs; keys must be unique and not cached."""
        if len(keys) == 0:
            return
        if vectors.shape[0] != len(keys) or vectors.ndim != 2:
            raise ValueError(f"{len(keys)} keys but vectors of shape {vectors.shape}")
        if self.dim is not None and vectors.shape[1] != self.dim:
            raise ValueError(f"vectors of dim {vectors.shape[1]} for a cache of dim {self.dim}")
        number = self._next_shard
        self._next_shard += 1
        _save_atomic(self._path(number, "vecs"), np.ascontiguousarray(vectors, dtype=np.float32))
        _save_atomic(self._path(number, "keys"), np.asarray(keys, dtype="S16"))
        shard = len(self._vectors)
        self._vectors.append(np.load(self._path(number, "vecs"), mmap_mode="r"))
        self._shard_numbers.append(number)
        # Merge the new keys into the sorted index: O(n) per shard, not a full re-sort.
        order = np.argsort(keys, kind="stable")
        new_keys = np.asarray(keys, dtype="S16")[order]
        at = np.searchsorted(self._keys, new_keys)
        self._keys = np.insert(self._keys, at, new_keys)
        self._shard = np.insert(self._shard, at, np.full(len(keys), shard, dtype=np.int32))
        self._row = np.insert(self._row, at, order.astype(np.int32))


class CachedEmbedder:
    """Embeds texts through an EmbeddingCache: only texts never seen are sent to the model.

    Duplicate texts inside one call are embedded once. `hits` and `misses` count texts
    served from the cache and texts sent to the model.
    """

    def __init__(self, embedder: Embedder, cache_dir: str | os.PathLike) -> None:
        self.embedder = embedder
        self.cache = EmbeddingCache(cache_dir, embedder.fingerprint)
        self.hits = 0
        self.misses = 0

    def embed_keyed(
        self, texts: Sequence[str], on_progress: Callable[[int], None] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(keys (n,) S16, vectors (n, dim) float32) for the texts, in order.

        `on_progress(done)` is called with how many of the texts are done (found in the
        cache at once, then embedded a slice at a time), so a caller can show progress
        inside a call that may take minutes."""
        keys = text_keys(texts)
        missing = ~self.cache.contains(keys)
        if missing.any():
            new_keys, first = np.unique(keys[missing], return_index=True)
            missing_positions = np.flatnonzero(missing)[first]
            to_embed = [texts[i] for i in missing_positions]
            done = len(texts) - len(to_embed)
            slices = []
            # Always sliced the same way, so a text's vector does not depend on whether
            # anyone watches the progress.
            for start in range(0, len(to_embed), EMBED_SLICE):
                if on_progress is not None:
                    on_progress(done + start)
                slices.append(self.embedder.embed(to_embed[start : start + EMBED_SLICE]))
            self.cache.add(new_keys, np.concatenate(slices))
        if on_progress is not None:
            on_progress(len(texts))
        self.misses += int(missing.sum())
        self.hits += len(texts) - int(missing.sum())
        if len(texts) == 0:
            return keys, np.zeros((0, self.cache.dim or 0), dtype=np.float32)
        return keys, self.cache.get(keys)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.embed_keyed(texts)[1]
