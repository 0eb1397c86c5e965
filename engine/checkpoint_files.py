"""What every random-weight checkpoint holds besides its tensors' values: per-name seeded
draws, the shard writer with model.safetensors.index.json, the byte-level tokenizer and
generation_config.json. Shared by the V3 maker (`engine/checkpoint_maker.py`), the V4
maker (`engine/deepseek_v4_checkpoint.py`) and their in-memory twin, the `random:` model
source (`engine/loader/random_source.py`), which writes the tokenizer files only."""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path

import torch

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
BOS_ID, EOS_ID = 256, 257
DEFAULT_SHARD_BYTES = 4 << 30


def prepare_output_dir(out: str | Path) -> Path:
    """`out`, created; refused when it exists and holds anything."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"output directory {out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    return out


def resolve_device(device: str) -> torch.device:
    """The device to draw on; "auto" takes the GPU when there is one."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def seeded_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator of its own per (seed, tensor name): a tensor's values do not depend on
    which other tensors a checkpoint holds or on their order."""
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return gen


def draw(name: str, shape: tuple[int, ...], std: float, mean: float, seed, device):
    """N(mean, std^2) float32 values of tensor `name`."""
    gen = seeded_generator(seed, name, device)
    return torch.randn(shape, generator=gen, device=device) * std + mean


def write_checkpoint(
    out: str | Path,
    config: dict,
    tensors: Iterable[tuple[str, torch.Tensor]],
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Write config.json, generation_config.json, the tokenizer and `tensors` (sharded, with
    the index) into `out` (created; must be empty if it exists) and return it."""
    out = prepare_output_dir(out)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_tokenizer_files(out, config["max_position_embeddings"])
    writer = ShardWriter(out, shard_bytes)
    for name, tensor in tensors:
        writer.add(name, tensor)
    writer.close()
    return out


def write_tokenizer_files(out: Path, max_length: int) -> None:
    """The tokenizer and generation_config.json every random checkpoint carries."""
    write_generation_config(out)
    write_tokenizer(out, max_length)


def write_generation_config(out: Path) -> None:
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}, indent=2)
    )


class ShardWriter:
    """Collects tensors on the host until a shard is full, writes it, and at the end
    renames the shards model-0000i-of-0000N.safetensors and writes the index."""

    def __init__(self, out: Path, shard_bytes: int) -> None:
        self.out, self.shard_bytes = out, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[Path] = []
        self.weight_map: dict[str, int] = {}
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor.detach().to("cpu").contiguous()
        self.pending_bytes += nbytes
        self.weight_map[name] = len(self.files)
        self.total += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"shard-{len(self.files):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append(path)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.files)
        names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for path, final in zip(self.files, names, strict=True):
            path.rename(self.out / final)
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": {k: names[i] for k, i in self.weight_map.items()},
        }
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tokenizer(out: Path, max_length: int) -> None:
    """A byte-level BPE over the 256 byte symbols (ids 0..255) plus BOS 256 and EOS 257:
    it encodes any text and fits every preset's vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_to_symbol = _byte_symbols()
    if sorted(alphabet) != sorted(byte_to_symbol):
        raise RuntimeError("unexpected byte-level alphabet in the tokenizers library")
    vocab = {sym: i for i, sym in enumerate(byte_to_symbol)}
    vocab[BOS], vocab[EOS] = BOS_ID, EOS_ID
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.save(str(out / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
        "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}{{ eos_token }}"
        "{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": True,
        "model_max_length": max_length,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order (id = byte value)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]
