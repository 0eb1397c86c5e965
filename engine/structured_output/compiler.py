"""Compiles GrammarSpecs against the model's tokenizer with xgrammar, caching by spec.

xgrammar was chosen over llguidance for its per-step mask cost on our tokenizers
(docs/notes-structured-output.md). It is imported here only, and only when a request asks
for a grammar, so the engine runs without it for free text.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

from engine.structured_output.grammar_spec import GrammarSpec

# Compiled grammars kept: a job with one schema compiles it once; per-row schemas beyond
# this many compile again when they come back.
CACHE_SIZE = 256
# xgrammar prefixes its errors with a time and a C++ source location.
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarError(ValueError):
    """A response_format that does not compile (bad schema, bad regex)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise GrammarError(
            "response_format needs the xgrammar package, which is not installed "
            "(pip install xgrammar)"
        ) from exc
    return xgrammar


class GrammarCompiler:
    """One per engine: the tokenizer's xgrammar view, built on the first constrained
    request, and the compiled grammars by spec."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()

    def _get_compiler(self):
        if self._compiler is None:
            if self.hf_tokenizer is None:
                raise GrammarError("response_format needs the model's tokenizer; it has none")
            if not self.stop_token_ids:
                raise GrammarError("response_format needs the model's EOS token; it has none")
            xgr = _xgrammar()
            info = xgr.TokenizerInfo.from_huggingface(
                self.hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec` (cached); GrammarError naming the problem."""
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
            return compiled
        compiler = self._get_compiler()
        try:
            compiled = self._compile(compiler, spec)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError and its own types
            message = _LOCATION.sub("", str(exc)).strip()
            raise GrammarError(f"response_format {spec.kind} does not compile: {message}") from exc
        self._cache[spec] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _compile(compiler, spec: GrammarSpec):
        if spec.kind in ("json_schema", "json_object"):
            schema = spec.source if spec.kind == "json_schema" else '{"type": "object"}'
            separators = None if spec.whitespace else (",", ":")
            return compiler.compile_json_schema(
                schema, any_whitespace=spec.whitespace, separators=separators
            )
        if spec.kind == "regex":
            return compiler.compile_regex(spec.source)
        # choice: an EBNF alternation of the literal strings (JSON escapes are EBNF's)
        choices = json.loads(spec.source)
        rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return compiler.compile_grammar(f"root ::= {rule}")
