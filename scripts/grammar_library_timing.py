"""Compile time and per-step mask cost of xgrammar and llguidance on one tokenizer.

    python scripts/grammar_library_timing.py [MODEL]      (default: smollm2-135m-instruct)

Needs both libraries (`pip install xgrammar llguidance`); the engine uses only llguidance.

For each grammar (JSON schemas, json_object, a regex, a choice list) it times: the first
compile on a fresh compiler, and over a valid output tokenized by the model's tokenizer the
mean time to fill one bitmask row and accept one token. The numbers went into
docs/notes-structured-output.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

SCHEMAS = {
    "person": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "review": (
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "aspects": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "aspect": {"type": "string", "maxLength": 40},
                            "polarity": {"enum": ["+", "-"]},
                        },
                        "required": ["aspect", "polarity"],
                        "additionalProperties": False,
                    },
                    "maxItems": 8,
                },
                "summary": {"type": "string"},
            },
            "required": ["sentiment", "score", "aspects", "summary"],
            "additionalProperties": False,
        },
        {
            "sentiment": "positive",
            "score": 0.82,
            "aspects": [
                {"aspect": "battery life", "polarity": "+"},
                {"aspect": "screen", "polarity": "-"},
            ],
            "summary": "Good phone with a dim screen, the battery lasts two days.",
        },
    ),
    "wide": (
        {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(40)
            },
            "required": [f"field_{i}" for i in range(40)],
            "additionalProperties": False,
        },
        {f"field_{i}": (i if i % 3 == 0 else None if i % 3 == 1 else f"v{i}") for i in range(40)},
    ),
}
REGEX = (r"\d{3}-\d{3}-\d{4}", "555-867-5309")
CHOICE = (["positive", "negative", "neutral"], "neutral")


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def grammars():
    """(name, kind, spec, valid output) tuples."""
    for name, (schema, instance) in SCHEMAS.items():
        yield f"schema:{name}", "schema", schema, _compact(instance)
    yield "json_object", "json_object", None, _compact(SCHEMAS["review"][1])
    yield "regex:phone", "regex", REGEX[0], REGEX[1]
    yield "choice:3", "choice", CHOICE[0], CHOICE[1]


def _choice_regex(choices: list[str]) -> str:
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def time_xgrammar(hf, vocab_size, cases):
    import torch
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size)
    setup = time.perf_counter() - t0
    rows = []
    for name, kind, spec, text in cases:
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        if kind == "schema":
            compiled = compiler.compile_json_schema(
                json.dumps(spec), any_whitespace=False, separators=(",", ":")
            )
        elif kind == "json_object":
            compiled = compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=(",", ":")
            )
        elif kind == "regex":
            compiled = compiler.compile_regex(spec)
        else:
            compiled = compiler.compile_regex(_choice_regex(spec))
        compile_s = time.perf_counter() - t0
        matcher = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab_size)
        steps = []
        for token in hf.encode(text, add_special_tokens=False):
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            ok = matcher.accept_token(token)
            steps.append(time.perf_counter() - t0)
            assert ok, f"xgrammar rejected a valid token of {name}"
        matcher.fill_next_token_bitmask(mask, 0)
        assert bool(torch.any(mask)), name
        rows.append((name, compile_s, statistics.mean(steps), max(steps), len(steps)))
    return setup, rows


def time_llguidance(hf, vocab_size, cases):
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size)
    setup = time.perf_counter() - t0
    rows = []
    for name, kind, spec, text in cases:
        t0 = time.perf_counter()
        if kind == "schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(spec), defaults={"whitespace_flexible": False}
            )
        elif kind == "json_object":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps({"type": "object"}), defaults={"whitespace_flexible": False}
            )
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(_choice_regex(spec))
        matcher = llguidance.LLMatcher(tok, grammar)
        mask = lt.allocate_token_bitmask(1, vocab_size)
        lt.fill_next_token_bitmask(matcher, mask, 0)  # the lexer is built lazily: count it
        compile_s = time.perf_counter() - t0
        assert not matcher.is_error(), matcher.get_error()
        steps = []
        tokens = hf.encode(text, add_special_tokens=False)
        for i, token in enumerate(tokens):
            t0 = time.perf_counter()
            if i:
                lt.fill_next_token_bitmask(matcher, mask, 0)
            ok = matcher.consume_token(token)
            steps.append(time.perf_counter() - t0)
            assert ok, f"llguidance rejected a valid token of {name}: {matcher.get_error()}"
        timed = steps[1:] or steps  # step 0's mask was counted in the compile
        rows.append((name, compile_s, statistics.mean(timed), max(timed), len(steps)))
    return setup, rows


def main(model: str = "smollm2-135m-instruct") -> None:
    from engine.loader import open_model_source

    hf = open_model_source(model).tokenizer.hf
    vocab_size = len(hf)
    cases = list(grammars())
    print(f"tokenizer of {model}: {vocab_size} tokens")
    for lib, timer in (("xgrammar", time_xgrammar), ("llguidance", time_llguidance)):
        setup, rows = timer(hf, vocab_size, cases)
        print(f"\n{lib}: tokenizer setup {setup * 1e3:.0f} ms")
        print(
            f"{'grammar':<16} {'compile ms':>10} {'mask+accept us':>15} {'max us':>8} {'steps':>6}"
        )
        for name, compile_s, mean_s, max_s, n in rows:
            print(
                f"{name:<16} {compile_s * 1e3:>10.1f} {mean_s * 1e6:>15.1f} {max_s * 1e6:>8.0f} {n:>6}"
            )


if __name__ == "__main__":
    main(*sys.argv[1:])
