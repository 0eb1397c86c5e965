"""Compiles GrammarSpecs against the model's tokenizer with llguidance, caching by spec.

llguidance was chosen over xgrammar (docs/notes-structured-output.md): its JSON strings
refuse raw control characters where xgrammar's length-bounded ones let them through, it
has no Python dependencies (the GPU image has no pydantic, which xgrammar imports), and its
per-step mask cost, though higher, is small beside a decode step. It is imported here and in
matcher.py / bitmask.py only, and only when a request asks for a grammar, so the engine
runs without it for free text.

A compiled grammar is a matcher in its start state that is never advanced: each sequence
gets a copy (`LLMatcher.deep_copy`, under a microsecond: the copies share the lexer).
"""

from __future__ import annotations

import json
from collections import OrderedDict

from engine.structured_output.grammar_spec import GrammarSpec

# Compiled grammars kept: a job with one schema compiles it once; per-row schemas beyond
# this many compile again when they come back.
CACHE_SIZE = 256


class GrammarError(ValueError):
    """A response_format that does not compile (bad schema, bad regex), or no library."""


def llguidance_module():
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch
    except ImportError as exc:
        raise GrammarError(
            "response_format needs the llguidance package, which is not installed "
            "(pip install llguidance)"
        ) from exc
    return llguidance


class GrammarCompiler:
    """One per engine: the tokenizer's llguidance view, built on the first constrained
    request, and the compiled grammars by spec."""

    def __init__(self, hf_tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        self.stop_token_ids = list(stop_token_ids)
        self._tokenizer = None
        self._cache: OrderedDict[GrammarSpec, object] = OrderedDict()

    def _get_tokenizer(self):
        if self._tokenizer is None:
            if self.hf_tokenizer is None:
                raise GrammarError("response_format needs the model's tokenizer; it has none")
            if not self.stop_token_ids:
                raise GrammarError("response_format needs the model's EOS token; it has none")
            llg = llguidance_module()
            eos = self.stop_token_ids[0] if len(self.stop_token_ids) == 1 else self.stop_token_ids
            self._tokenizer = llg.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos
            )
        return self._tokenizer

    def compile(self, spec: GrammarSpec):
        """The start-state matcher of `spec` (cached; copy it, never advance it);
        GrammarError naming the problem."""
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
            return compiled
        tokenizer = self._get_tokenizer()
        llg = llguidance_module()
        try:
            grammar = _grammar(llg.LLMatcher, spec)
            problem = llg.LLMatcher.validate_grammar(grammar, tokenizer)
        except Exception as exc:  # llguidance raises ValueError and its own types
            problem = str(exc)
        if not problem:
            compiled = llg.LLMatcher(tokenizer, grammar)
            problem = compiled.get_error() if compiled.is_error() else ""
        if problem:
            raise GrammarError(f"response_format {spec.kind} does not compile: {problem.strip()}")
        self._cache[spec] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled


def _grammar(matcher_cls, spec: GrammarSpec) -> str:
    """llguidance's grammar text for a spec."""
    if spec.kind in ("json_schema", "json_object"):
        schema = spec.source if spec.kind == "json_schema" else '{"type": "object"}'
        return matcher_cls.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": spec.whitespace}
        )
    if spec.kind == "regex":
        return matcher_cls.grammar_from_regex(spec.source)
    # choice: a Lark alternation of the literal strings (JSON's escapes are Lark's)
    choices = json.loads(spec.source)
    return matcher_cls.grammar_from_lark(
        "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    )
