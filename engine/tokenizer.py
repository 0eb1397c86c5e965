"""The model's tokenizer and chat template, wrapping a Hugging Face fast tokenizer.

Sources: a Hugging Face directory (tokenizer.json / tokenizer_config.json / ...) or a GGUF
file, whose vocabulary, merges and chat template transformers converts offline.
"""

from __future__ import annotations

import json
import logging
from bisect import bisect_right
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "tiktoken.model",
)


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _declares_tokenizer_class(path: Path) -> bool:
    try:
        return bool(json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class"))
    except (OSError, ValueError, AttributeError):
        return False


class Tokenizer:
    """Text <-> token ids, special tokens and the chat template of one model."""

    def __init__(self, hf_tokenizer, extra_eos_token_ids: list[int] | None = None) -> None:
        self.hf = hf_tokenizer
        eos = _ids(hf_tokenizer.eos_token_id) + list(extra_eos_token_ids or [])
        self._eos_token_ids = list(dict.fromkeys(eos))  # keep order, drop repeats

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer | None:
        """The tokenizer of a Hugging Face directory, or None when it has no tokenizer
        files (such a model still runs on token-id prompts)."""
        path = Path(path)
        if not any((path / f).is_file() for f in TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer, PretrainedConfig

        kwargs = {}
        if _declares_tokenizer_class(path):
            # the tokenizer files say what they are: transformers need not parse the
            # model's config.json, which it cannot for configs it does not model (a tiny
            # DeepSeek-V4 with an HCA ratio other than 128)
            kwargs["config"] = PretrainedConfig()
        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
        except Exception as exc:  # transformers raises many types for broken files
            raise ValueError(f"cannot load the tokenizer in {path}: {exc}") from exc
        return cls(hf, _generation_eos(path))

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata."""
        path = Path(path)
        from transformers import AutoTokenizer

        # transformers logs every unparsed metadata key at warning level; quiet it here.
        logger = logging.getLogger("transformers.modeling_gguf_pytorch_utils")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            hf = AutoTokenizer.from_pretrained(
                str(path.parent), gguf_file=path.name, local_files_only=True
            )
        except Exception as exc:
            raise ValueError(f"cannot load the tokenizer from GGUF file {path}: {exc}") from exc
        finally:
            logger.setLevel(level)
        return cls(hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @cached_property
    def special_tokens(self) -> list[str]:
        """Every string this tokenizer turns into a special token (BOS, EOS, role markers,
        reserved tokens), longest first."""
        tokens = {t.content for t in self.hf.added_tokens_decoder.values() if t.special}
        tokens.update(self.hf.all_special_tokens)
        return sorted((t for t in tokens if t), key=lambda t: (-len(t), t))

    @cached_property
    def special_token_ids(self) -> frozenset[int]:
        ids = {i for i, t in self.hf.added_tokens_decoder.items() if t.special}
        return frozenset(ids | set(self.hf.all_special_ids))

    def encode_with_data(
        self,
        text: str,
        data_spans: Sequence[tuple[int, int]],
        add_special_tokens: bool = True,
    ) -> list[int]:
        """Token ids of `text` in which no special token comes from data.

        `data_spans` are sorted, disjoint [start, end) character ranges of `text` that hold
        data (a prompt's row values). A special token the tokenizer finds inside one, or
        across its edge, is encoded as ordinary text instead; special tokens elsewhere stay
        special. Text without such a token encodes exactly as `encode` does."""
        affixes = self._post_processor_affixes if add_special_tokens else ([], [])
        ids, offsets = self._ids_and_offsets(text)
        starts = [s for s, _ in data_spans]
        kept: list[tuple[int, int, int]] = []  # (start, end, id) of the text's own specials
        forged = False
        for token, (start, end) in zip(ids, offsets):
            if token not in self.special_token_ids:
                continue
            i = bisect_right(starts, end - 1) - 1  # the last span starting inside the token
            if start < end and i >= 0 and data_spans[i][1] > start:
                forged = True
            else:
                kept.append((start, end, token))
        if forged:
            ids, pos = [], 0
            for start, end, token in kept:
                ids += self._ordinary(text[pos:start])
                ids.append(token)
                pos = end
            ids += self._ordinary(text[pos:])
        return affixes[0] + ids + affixes[1]

    def _ids_and_offsets(
        self, text: str, split_special_tokens: bool = False
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and their character ranges, without the post-processor's tokens;
        split_special_tokens encodes special-token strings as the text they spell."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            enc = self.hf(
                text,
                add_special_tokens=False,
                return_offsets_mapping=True,
                split_special_tokens=split_special_tokens,
            )
            return list(enc["input_ids"]), enc["offset_mapping"]
        # A fast tokenizer: straight to the Rust encoder. The flag is state on it (as
        # transformers itself sets it on each call), so set it and put it back.
        previous = backend.encode_special_tokens
        backend.encode_special_tokens = split_special_tokens
        try:
            enc = backend.encode(text, add_special_tokens=False)
        finally:
            backend.encode_special_tokens = previous
        return enc.ids, enc.offsets

    def _ordinary(self, text: str) -> list[int]:
        """`text` with special-token strings encoded as the plain text they spell."""
        return self._ids_and_offsets(text, split_special_tokens=True)[0] if text else []

    @cached_property
    def _post_processor_affixes(self) -> tuple[list[int], list[int]]:
        """The ids `encode(..., add_special_tokens=True)` puts before and after a text (BOS,
        EOS), found by encoding one letter both ways."""
        bare = self.encode("a", add_special_tokens=False)
        full = self.encode("a", add_special_tokens=True)
        for at in range(len(full) - len(bare) + 1):
            if full[at : at + len(bare)] == bare:
                return full[:at], full[at + len(bare) :]
        raise ValueError("the tokenizer's special tokens do not wrap the text it encodes")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        return getattr(self.hf, "chat_template", None) or None

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for a conversation ([{"role": ..., "content": ...}, ...])."""
        if not self.has_chat_template:
            raise ValueError(
                "this model's tokenizer has no chat template; pass plain text prompts "
                "(or a job with prompt.chat: false)"
            )
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: the tokenizer's eos plus generation_config's."""
        return list(self._eos_token_ids)

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)


def _generation_eos(path: Path) -> list[int]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return []
    try:
        return _ids(json.loads(gen.read_text()).get("eos_token_id"))
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"cannot read eos_token_id from {gen}: {exc}") from exc
