"""A token id's text and raw bytes, for logprob entries (OpenAI's `token` and `bytes`)."""

from __future__ import annotations

from functools import lru_cache

from engine.outputs import TokenLogprob, TopLogprob


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for: printable
    Latin-1 bytes stand for themselves, the other 68 for chr(256 + i) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


class TokenText:
    """Resolves token ids through the model's tokenizer, caching each id's answer."""

    def __init__(self, tokenizer) -> None:
        self.hf = tokenizer.hf if tokenizer is not None else None
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._resolve(token_id)
        return found

    def _resolve(self, token_id: int) -> tuple[str, bytes]:
        if self.hf is None:  # a model without a tokenizer: the id is all there is
            return f"<{token_id}>", b""
        text = self.hf.decode([token_id], skip_special_tokens=False)
        piece = self.hf.convert_ids_to_tokens(token_id)
        if self._byte_level and isinstance(piece, str):
            alphabet = _byte_level_alphabet()
            if all(ch in alphabet for ch in piece):
                return text, bytes(alphabet[ch] for ch in piece)
        if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x"):
            try:  # SentencePiece byte fallback: <0xAB>
                return text, bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return text, text.encode("utf-8")

    def entries(self, output_ids: list[int], logprobs: dict) -> list[TokenLogprob]:
        """The TokenLogprob of each output token from its SampledLogprobs."""
        out = []
        for pos, token_id in enumerate(output_ids):
            entry = logprobs.get(pos)
            if entry is None:  # cannot happen for a sequence that asked for logprobs
                raise RuntimeError(f"no logprobs recorded for output position {pos}")
            top = [TopLogprob(t, *self(t), lp) for t, lp in zip(entry.top_ids, entry.top_logprobs)]
            out.append(TokenLogprob(token_id, *self(token_id), entry.logprob, top))
        return out
