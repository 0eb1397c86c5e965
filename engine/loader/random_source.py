"""`random:<preset>[?key=value&...]`: a random-weight model made in memory, the twin of the
directory `batchgen models make-random` writes, for models whose checkpoint the disk would
not hold (DeepSeek-V4-Flash is ~150 GB in its hub formats).

    LLM("random:v4-flash")                          # 43 layers + MTP, FP8 + MXFP4
    LLM("random:moonlight-16b-a3b?weights=bf16&layers=4")
    LLM("random:tiny?arch=deepseek_v4&weights=fp8-mxfp4&seed=3")
    LLM("random:tiny?arch=llama")

Keys (each at most once; any other is an error naming it):
- `arch`: deepseek_v3 | deepseek_v4 | llama; needed only for a preset several have
  (`tiny`).
- `layers`: N, the first N layers at the preset's shapes (make-random's --layers).
- `weights`: <dense>[-<experts>], e.g. bf16, fp8, fp8-mxfp4 (make-random's --dense-dtype
  and --expert-dtype). Default: the format the real model ships in (v4-flash fp8-mxfp4,
  deepseek-v3-671b fp8, moonlight-16b-a3b bf16); tiny: bf16, make-random's default.
- `seed`: S (default 0). `mtp`: 1 | 0, DeepSeek's MTP layer (default 1, as make-random).
- `device`: where the weights are drawn; default the device the model loads onto.

The source streams `RandomCheckpoint.tensors`, the stream make-random writes: the same hub
names, formats and config.json, through the same loader path as a directory (the model's
name mapping, strict loading, process_weights_after_loading), one tensor at a time, so the
model is never held twice. Tensors are drawn and quantized on the drawing device and the
loader copies each into its parameter there (device to device on a GPU: nothing crosses
PCIe and the host's cores draw nothing). Each tensor has its own generator seeded by
(seed, name), so the weights equal those make-random writes with the same seed when both
draw on the same device type (`make-random --device cpu` and a model drawn on the CPU are
bitwise equal); torch's CPU and CUDA generators give different numbers for one seed. The
tokenizer is make-random's byte-level BPE, built from files written to a temporary
directory that is removed once it is loaded.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.checkpoint_files import write_tokenizer_files
from engine.checkpoint_maker import FAMILY_PRESETS, RandomCheckpoint
from engine.loader.model_source import ModelSource, register_scheme
from engine.loader.quant_methods import quant_config_from_hf
from engine.tokenizer import Tokenizer

SCHEME = "random"
KEYS = ("arch", "layers", "weights", "seed", "mtp", "device")
# the format each real model ships in; presets not listed default to bf16
DEFAULT_WEIGHTS = {"v4-flash": "fp8-mxfp4", "deepseek-v3-671b": "fp8"}
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
# Stored floating dtypes an explicit dtype converts (as the safetensors source does); fp8
# codes, packed int8 nibbles, E8M0 scales and int64 tid2eid pass through as stored.
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class RandomModelSpec:
    """A parsed `random:` spec: the model, and where to draw it (None: where it loads)."""

    checkpoint: RandomCheckpoint
    device: str | None = None


def parse_random_spec(spec: str) -> RandomModelSpec:
    """`spec` is the whole name, "random:<preset>[?key=value&...]" (module docstring).
    Raises ValueError naming the spec and what is wrong with it."""
    prefix = f"{SCHEME}:"
    if not spec.startswith(prefix):
        raise ValueError(f"model spec {spec!r} does not start with {prefix!r}")
    preset, _, query = spec[len(prefix) :].partition("?")
    options = _query(spec, query)

    def fail(problem: str) -> ValueError:
        return ValueError(f"model spec {spec!r}: {problem}")

    arch = options.pop("arch", None)
    if arch is not None and arch not in FAMILY_PRESETS:
        raise fail(f"arch {arch!r} is not one of {sorted(FAMILY_PRESETS)}")
    arch = arch or _arch_of(preset, fail)
    if preset not in FAMILY_PRESETS[arch]:
        raise fail(f"{arch} has no preset {preset!r}; it has {sorted(FAMILY_PRESETS[arch])}")
    weights = options.pop("weights", DEFAULT_WEIGHTS.get(preset, "bf16"))
    dense, sep, experts = weights.partition("-")
    if not dense or (sep and not experts) or "-" in experts:
        raise fail(f"weights {weights!r}: expected <dense>[-<experts>], e.g. bf16 or fp8-mxfp4")
    layers = options.pop("layers", None)
    seed = options.pop("seed", "0")
    mtp = options.pop("mtp", "1")
    if mtp.lower() not in _BOOLS:
        raise fail(f"mtp {mtp!r}: expected 1 or 0")
    device = options.pop("device", None)
    if device is not None:
        try:
            torch.device(device)
        except RuntimeError as exc:
            raise fail(f"device {device!r} is not a torch device ({exc})") from None
    try:
        checkpoint = RandomCheckpoint(
            arch=arch,
            preset=preset,
            layers=None if layers is None else _int(layers, "layers", fail),
            dense_dtype=dense,
            expert_dtype=experts or dense,
            seed=_int(seed, "seed", fail),
            mtp=_BOOLS[mtp.lower()],
        )
    except ValueError as exc:
        raise fail(str(exc)) from None
    return RandomModelSpec(checkpoint, device)


def _query(spec: str, query: str) -> dict[str, str]:
    options: dict[str, str] = {}
    for item in query.split("&") if query else []:
        key, eq, value = item.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"model spec {spec!r}: {item!r} is not key=value")
        if key not in KEYS:
            raise ValueError(f"model spec {spec!r}: unknown key {key!r}; the keys are {KEYS}")
        if key in options:
            raise ValueError(f"model spec {spec!r}: key {key!r} is given twice")
        options[key] = value
    return options


def _arch_of(preset: str, fail) -> str:
    archs = [arch for arch, presets in FAMILY_PRESETS.items() if preset in presets]
    if len(archs) == 1:
        return archs[0]
    if archs:
        choices = " or ".join(f"?arch={a}" for a in archs)
        raise fail(f"preset {preset!r} exists for {', '.join(archs)}: add {choices}")
    known = "; ".join(f"{arch}: {', '.join(sorted(p))}" for arch, p in FAMILY_PRESETS.items())
    raise fail(f"unknown preset {preset!r} (presets: {known})")


def _int(text: str, key: str, fail) -> int:
    try:
        return int(text)
    except ValueError:
        raise fail(f"{key} {text!r} is not an integer") from None


def open_random_model(
    name: str, _rest: str, dtype: torch.dtype | None, device: str | torch.device | None
) -> ModelSource:
    spec = parse_random_spec(name)
    checkpoint = spec.checkpoint
    # as read back from config.json: lists, not tuples, and only JSON types
    config = json.loads(json.dumps(checkpoint.config()))
    draw_on = torch.device(spec.device or device or "cpu")

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for tensor_name, tensor in checkpoint.tensors(draw_on):
            if dtype is not None and tensor.dtype in _FLOAT_DTYPES:
                tensor = tensor.to(dtype)
            yield tensor_name, tensor

    return ModelSource(
        name=name,
        path=None,
        config=config,
        quant_config=quant_config_from_hf(config, f"{name} (config.json)"),
        weight_stream=stream,
        tokenizer_loader=lambda: _tokenizer(config["max_position_embeddings"]),
        format=SCHEME,
    )


def _tokenizer(max_length: int) -> Tokenizer | None:
    """make-random's tokenizer files, written to a temporary directory and loaded from it
    (the loaded tokenizer keeps no reference to the files)."""
    with tempfile.TemporaryDirectory(prefix="batchgen-random-tokenizer-") as tmp:
        write_tokenizer_files(Path(tmp), max_length)
        return Tokenizer.from_dir(tmp)


register_scheme(SCHEME, open_random_model)
