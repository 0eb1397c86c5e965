"""The model's tokenizer and chat template, wrapping a Hugging Face fast tokenizer.

Sources: a Hugging Face directory (tokenizer.json / tokenizer_config.json / ...) or a GGUF
file, whose vocabulary, merges and chat template transformers converts offline.
"""

from __future__ import annotations

import json
import logging
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
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
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
