"""A model, opened: its config, weight formats, tokenizer and a weight stream.

`open_model_source` accepts a catalog alias, a model directory, a model file or a
`scheme:` spec. A path goes to the format registered for it: a directory kind is known by
a marker file in it (a Hugging Face directory by config.json), a file kind by its suffix
(GGUF by .gguf; a directory holding exactly one such file opens that file). A name that
starts with a registered scheme and a colon (`random:v4-flash`) goes to that scheme's
opener, which makes the model without files. Each format's or scheme's module registers
its opener here (`register_format`, `register_scheme`); engine/loader/__init__.py imports
them, so this module never imports them. Weights are streamed one tensor at a time under Hugging
Face names; the model's `load_weights` copies each into place, so no checkpoint is ever
held twice in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from engine.quant.base import QuantConfig
from engine.tokenizer import Tokenizer


@dataclass
class ModelSource:
    name: str  # what the user asked for (alias, path or scheme spec)
    path: Path | None  # the resolved file or directory; None for a model made in memory
    config: dict  # Hugging Face config.json keys
    quant_config: QuantConfig
    weight_stream: Callable[[], Iterator[tuple[str, torch.Tensor]]] = field(repr=False)
    tokenizer_loader: Callable[[], Tokenizer | None] = field(repr=False)
    format: str = "safetensors"  # "safetensors" | "gguf" | a scheme ("random")

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor) for every tensor of the checkpoint, one at a time."""
        return self.weight_stream()

    @cached_property
    def tokenizer(self) -> Tokenizer | None:
        """Loaded on first use (a GGUF vocabulary takes seconds to convert)."""
        return self.tokenizer_loader()

    @property
    def declared_context(self) -> int | None:
        """The context length the config declares (config.json's max_position_embeddings,
        a GGUF file's context_length), known without building the model; None when the
        config leaves it to the model family's default."""
        value = self.config.get("max_position_embeddings")
        return int(value) if value is not None else None


# (name the user gave, resolved path, dtype, device) -> ModelSource
Opener = Callable[[str, Path, torch.dtype | None, str | torch.device | None], ModelSource]


@dataclass(frozen=True)
class SourceFormat:
    """One on-disk format: a directory known by `marker` (a file inside it) or a file known
    by `suffix` (lower case, with the dot). `title` names it in error messages."""

    name: str
    title: str
    opener: Opener
    marker: str | None = None
    suffix: str | None = None

    def __post_init__(self) -> None:
        if (self.marker is None) == (self.suffix is None):
            raise ValueError(f"format {self.name!r}: give exactly one of marker and suffix")


_FORMATS: dict[str, SourceFormat] = {}
# (name the user gave, the spec after "scheme:", dtype, device) -> ModelSource
SchemeOpener = Callable[[str, str, torch.dtype | None, str | torch.device | None], ModelSource]
_SCHEMES: dict[str, SchemeOpener] = {}


def register_format(fmt: SourceFormat) -> None:
    """Make a format openable by `open_model_source` (its module calls this on import)."""
    _FORMATS[fmt.name] = fmt


def register_scheme(scheme: str, opener: SchemeOpener) -> None:
    """Make `scheme:...` names openable by `open_model_source` (its module calls this on
    import). `scheme` is lower-case letters, at least two, so no Windows drive letter or
    relative path is taken for one."""
    if not (len(scheme) >= 2 and scheme.isalpha() and scheme.islower()):
        raise ValueError(f"model scheme {scheme!r}: use two or more lower-case letters")
    _SCHEMES[scheme] = opener


def spec_scheme(name: str) -> str | None:
    """The registered scheme `name` starts with (`random` for "random:tiny"), else None."""
    scheme, colon, _ = name.partition(":")
    return scheme if colon and scheme in _SCHEMES else None


def _directory_formats() -> list[SourceFormat]:
    return [f for f in _FORMATS.values() if f.marker is not None]


def _file_formats() -> list[SourceFormat]:
    return [f for f in _FORMATS.values() if f.suffix is not None]


def open_model_source(
    model: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> ModelSource:
    """Open `model` for loading.

    dtype None ("auto") keeps quantized weights in their stored form (GGUF blocks become
    small CPU kernels); an explicit dtype dequantizes GGUF weights to it (float32: exact,
    for parity tests). `device` is where the model will live: it tells the GGUF formats
    whether the CPU kernels apply, and a scheme that makes weights where to make them.
    """
    from engine.loader.catalog import is_alias, resolve_model

    name = str(model)
    scheme = spec_scheme(name)
    if scheme is not None:
        return _SCHEMES[scheme](name, name[len(scheme) + 1 :], dtype, device)
    path = resolve_model(name) if is_alias(name) else Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {name!r}: no such file or directory, and not a known model alias "
            "(see `batchgen models list`)"
        )
    if path.is_dir():
        for fmt in _directory_formats():
            if (path / fmt.marker).is_file():
                return fmt.opener(name, path, dtype, device)
        path = _single_model_file(path)
    for fmt in _file_formats():
        if path.suffix.lower() == fmt.suffix:
            return fmt.opener(name, path, dtype, device)
    files = " or ".join(f"{f.title} ({f.suffix})" for f in _file_formats())
    dirs = "; ".join(
        f"for {f.name} pass the directory holding {f.marker}" for f in _directory_formats()
    )
    raise ValueError(f"{path}: a model file must be {files}; {dirs}")


def _single_model_file(directory: Path) -> Path:
    """The one model file in a directory no directory format claims."""
    for fmt in _file_formats():
        found = sorted(directory.glob(f"*{fmt.suffix}"))
        if len(found) > 1:
            listed = ", ".join(p.name for p in found)
            raise ValueError(
                f"{directory} holds several {fmt.title} files ({listed}); pass one of them"
            )
        if found:
            return found[0]
    kinds = [f"{f.marker} ({f.title} layout)" for f in _directory_formats()]
    kinds += [f"{f.suffix} file" for f in _file_formats()]
    raise FileNotFoundError(f"{directory} has no {' and no '.join(kinds)}")
