"""A response_format, checked and reduced to what a grammar is compiled from."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice")


@dataclass(frozen=True)
class GrammarSpec:
    """What to compile: `kind` one of KINDS and `source` its text (the schema as canonical
    JSON, the regex, or the choices as a JSON list); `whitespace`: JSON may hold free
    whitespace. Hashable: the compiler caches by it."""

    kind: str
    source: str
    whitespace: bool = False


def grammar_spec(response_format: dict | None, json_whitespace: bool = False) -> GrammarSpec | None:
    """The GrammarSpec of an OpenAI-shaped response_format (None or type "text": None).
    A malformed one raises ValueError naming the key at fault."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind not in KINDS:
        raise ValueError(
            f"response_format.type must be one of text, {', '.join(KINDS)}; got {kind!r}"
        )
    if kind == "json_schema":
        body = response_format.get("json_schema")
        if not isinstance(body, dict):
            raise ValueError("response_format.json_schema must be an object with a 'schema' key")
        schema = body.get("schema")
        if not isinstance(schema, dict):
            raise ValueError(
                "response_format.json_schema.schema must be a JSON schema object, "
                f"got {type(schema).__name__}"
            )
        # key order kept: the grammar emits properties in the schema's order
        return GrammarSpec(kind, json.dumps(schema), json_whitespace)
    if kind == "json_object":
        return GrammarSpec(kind, "", json_whitespace)
    if kind == "regex":
        regex = response_format.get("regex")
        if not isinstance(regex, str) or not regex:
            raise ValueError("response_format.regex must be a non-empty string")
        return GrammarSpec(kind, regex)
    choices = response_format.get("choice")
    if (
        not isinstance(choices, list)
        or not choices
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ValueError("response_format.choice must be a non-empty list of non-empty strings")
    return GrammarSpec(kind, json.dumps(choices))
