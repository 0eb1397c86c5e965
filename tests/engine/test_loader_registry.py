"""open_model_source hands a path to the format registered for it (engine/loader)."""

from __future__ import annotations

import pytest

from engine.loader import model_source
from engine.loader.model_source import SourceFormat, open_model_source


def _recording_format(name, seen, **kind):
    def opener(user_name, path, dtype, device):
        seen.append((name, user_name, path, dtype, device))
        return name

    return SourceFormat(name=name, title=name.upper(), opener=opener, **kind)


def test_registered_formats_open_by_suffix_and_marker(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setitem(model_source._FORMATS, "toy", _recording_format("toy", seen, suffix=".toy"))
    monkeypatch.setitem(
        model_source._FORMATS, "toydir", _recording_format("toydir", seen, marker="toy.json")
    )
    (tmp_path / "m.toy").write_bytes(b"x")
    assert open_model_source(str(tmp_path / "m.toy"), device="cpu") == "toy"
    # a directory with no marker but exactly one file of a file format opens that file
    assert open_model_source(tmp_path) == "toy"
    (tmp_path / "toy.json").write_text("{}")
    assert open_model_source(tmp_path) == "toydir"
    assert [s[0] for s in seen] == ["toy", "toy", "toydir"]
    assert seen[0][2] == tmp_path / "m.toy" and seen[0][4] == "cpu"
    assert seen[1][2] == tmp_path / "m.toy" and seen[1][1] == str(tmp_path)


def test_errors_name_the_registered_formats(tmp_path, monkeypatch):
    monkeypatch.setitem(model_source._FORMATS, "toy", _recording_format("toy", [], suffix=".toy"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"GGUF \(\.gguf\) or TOY \(\.toy\)"):
        open_model_source(tmp_path / "weights.bin")
    with pytest.raises(
        FileNotFoundError, match=r"no config.json .* and no \.gguf file and no \.toy"
    ):
        open_model_source(tmp_path)
    (tmp_path / "a.toy").write_bytes(b"x")
    (tmp_path / "b.toy").write_bytes(b"x")
    with pytest.raises(ValueError, match="several TOY files"):
        open_model_source(tmp_path)


def test_a_format_is_a_directory_kind_or_a_file_kind():
    with pytest.raises(ValueError, match="exactly one of marker and suffix"):
        SourceFormat(name="x", title="X", opener=lambda *a: None)
    with pytest.raises(ValueError, match="exactly one of marker and suffix"):
        SourceFormat(name="x", title="X", opener=lambda *a: None, marker="m", suffix=".m")
