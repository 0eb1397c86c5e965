"""Structured output: a response_format compiled to a grammar, one matcher per sequence,
and the token bitmask that keeps each step's sample inside the grammar.

grammar_spec.py checks a response_format's shape (no library needed); compiler.py compiles
it with llguidance (imported lazily: the engine runs without it until a request asks for a
grammar); matcher.py follows one sequence's tokens; bitmask.py fills a batch's mask rows.
"""

from engine.structured_output.grammar_spec import GrammarSpec, grammar_spec

__all__ = ["GrammarSpec", "grammar_spec"]
