from __future__ import annotations

import os

import numpy as np
import pytest

from clustering.embed import text_key
from clustering.embedding_cache import CachedEmbedder, EmbeddingCache
from tests.clustering.conftest import HashEmbedder


def test_second_pass_embeds_nothing_and_returns_the_same_vectors(tmp_path):
    texts = [f"prompt number {i}" for i in range(50)]
    first = HashEmbedder()
    vectors = CachedEmbedder(first, tmp_path).embed(texts)
    assert first.texts_embedded == 50

    again = HashEmbedder()  # a new process: a fresh embedder over the same directory
    cached = CachedEmbedder(again, tmp_path)
    np.testing.assert_array_equal(cached.embed(texts[::-1]), vectors[::-1])
    assert again.texts_embedded == 0 and again.calls == []
    assert cached.hits == 50 and cached.misses == 0


def test_only_new_texts_are_embedded_and_duplicates_once(tmp_path):
    embedder = HashEmbedder()
    cached = CachedEmbedder(embedder, tmp_path)
    cached.embed(["a", "b"])
    out = cached.embed(["b", "c", "c", "d", "a"])
    assert sorted(embedder.calls[1]) == ["c", "d"]
    np.testing.assert_array_equal(out[1], out[2])
    assert len(cached.cache) == 4


def test_models_do_not_share_vectors(tmp_path):
    CachedEmbedder(HashEmbedder(fingerprint="model-a"), tmp_path).embed(["x"])
    other = HashEmbedder(fingerprint="model-b")
    CachedEmbedder(other, tmp_path).embed(["x"])
    assert other.texts_embedded == 1


def test_keys_ending_in_nul_bytes_round_trip(tmp_path):
    # numpy's S16 strips trailing NULs on access; lookups must still match.
    keys = np.array([b"\x01" * 15 + b"\x00", b"\x02" * 14 + b"\x00\x00"], dtype="S16")
    cache = EmbeddingCache(tmp_path, "m")
    vectors = np.eye(2, dtype=np.float32)
    cache.add(keys, vectors)
    reopened = EmbeddingCache(tmp_path, "m")
    np.testing.assert_array_equal(reopened.get(keys[::-1]), vectors[::-1])


def test_a_shard_cut_short_by_a_crash_is_ignored(tmp_path):
    cache = EmbeddingCache(tmp_path, "m")
    cache.add(np.array([text_key("kept")], dtype="S16"), np.ones((1, 4), np.float32))
    # A crash after the vectors were renamed into place but before the keys were: the
    # shard is not committed. And a crash mid-write leaves a .tmp file.
    np.save(cache.directory / "shard-000002.vecs.npy", np.ones((3, 4), np.float32))
    (cache.directory / "shard-000003.keys.npy.tmp").write_bytes(b"partial")
    reopened = EmbeddingCache(tmp_path, "m")
    assert len(reopened) == 1
    assert not (cache.directory / "shard-000003.keys.npy.tmp").exists()
    new_key = np.array([text_key("new")], dtype="S16")
    reopened.add(new_key, np.zeros((1, 4), np.float32))
    # The new shard took a number after the orphan's, and its vectors are its own.
    assert "shard-000003.keys.npy" in os.listdir(cache.directory)
    final = EmbeddingCache(tmp_path, "m")
    assert len(final) == 2
    np.testing.assert_array_equal(final.get(new_key), np.zeros((1, 4), np.float32))


def test_missing_keys_and_wrong_dims_are_errors(tmp_path):
    cache = EmbeddingCache(tmp_path, "m")
    cache.add(np.array([text_key("a")], dtype="S16"), np.ones((1, 4), np.float32))
    with pytest.raises(KeyError, match="1 of 1 keys"):
        cache.get(np.array([text_key("b")], dtype="S16"))
    with pytest.raises(ValueError, match="dim 3"):
        cache.add(np.array([text_key("c")], dtype="S16"), np.ones((1, 3), np.float32))


def test_real_model_cache_reuse(embedder, tmp_path):
    texts = ["Summarize this memo in one line.", "Fix the grammar: he go to school."]
    before = embedder.texts_embedded
    first = CachedEmbedder(embedder, tmp_path).embed(texts)
    second = CachedEmbedder(embedder, tmp_path).embed(texts)
    assert embedder.texts_embedded - before == 2  # the second pass embedded nothing
    np.testing.assert_array_equal(first, second)
