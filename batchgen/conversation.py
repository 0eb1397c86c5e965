"""Chat rows: a conversation as a list of {role, content} messages, checked before it
is rendered through the model's chat template. Content is text, given as a string or as
a list of text parts ({"type": "text", "text": ...}, as both batch APIs allow); any other
part (an image, a tool call) is refused by name, since the models here read text only."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from batchgen.batch_api.request_params import RequestError, described

OPENAI_ROLES = ("system", "developer", "user", "assistant")
ANTHROPIC_ROLES = ("user", "assistant")
# OpenAI's "developer" is the system prompt of newer models: chat templates know "system".
_ROLE_ALIASES = {"developer": "system"}
MAX_MESSAGES = 10_000


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def content_text(label: str, value: Any) -> str:
    """A message's text: a string, or the text parts of a list joined."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (list, tuple)) or not value:
        raise RequestError(label, f"expected a string or a list of text parts, {described(value)}")
    texts = []
    for i, part in enumerate(value):
        where = f"{label}[{i}]"
        if not isinstance(part, dict):
            raise RequestError(where, f"expected a {{type: text, text}} part, {described(part)}")
        if part.get("type") != "text":
            raise RequestError(
                f"{where}.type", f"only text parts are supported, {described(part.get('type'))}"
            )
        unknown = sorted(k for k in part if k not in ("type", "text", "cache_control"))
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", "unknown key")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{where}.text", f"expected a string, {described(text)}")
        texts.append(text)
    return "\n".join(texts)


def parse_messages(label: str, value: Any, roles: Collection[str]) -> list[Message]:
    """Validate a conversation; RequestError names the first wrong key, e.g.
    `body.messages[2].role`."""
    if hasattr(value, "tolist"):  # a numpy array from a Parquet list column
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise RequestError(label, f"expected a non-empty list of messages, {described(value)}")
    if len(value) > MAX_MESSAGES:
        raise RequestError(label, f"at most {MAX_MESSAGES:,} messages, got {len(value):,}")
    messages = []
    for i, item in enumerate(value):
        where = f"{label}[{i}]"
        if not isinstance(item, dict):
            raise RequestError(where, f"expected a {{role, content}} object, {described(item)}")
        unknown = sorted(k for k in item if k not in ("role", "content"))
        if unknown:
            raise RequestError(f"{where}.{unknown[0]}", "unknown key")
        role = item.get("role")
        if role not in roles:
            raise RequestError(
                f"{where}.role", f"expected one of {', '.join(roles)}, {described(role)}"
            )
        if "content" not in item or item["content"] is None:
            raise RequestError(f"{where}.content", "missing")
        text = content_text(f"{where}.content", item["content"])
        messages.append(Message(_ROLE_ALIASES.get(role, role), text))
    return messages


def without_nulls(value: Any) -> Any:
    """A Parquet list<struct> column gives every struct field of every message, null where
    the message has none: those keys are not set, not unknown."""
    if isinstance(value, list):
        return [
            {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
            for m in value
        ]
    return value


def conversation_text(messages: list[Message]) -> str:
    """The text of a conversation for embedding (task clustering): its messages' text,
    system prompt left out (it is shared by many rows and says little of the task)."""
    return "\n".join(m.content for m in messages if m.role != "system")
