"""One request of a batch file, parsed: what to generate from (a conversation, or a
completion prompt) and the parameters it sets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchgen.conversation import Message

CHAT = "chat"  # a conversation through the chat template (OpenAI chat, Anthropic)
COMPLETION = "completion"  # a prompt continued as it is (OpenAI /v1/completions)


@dataclass
class BatchRequest:
    endpoint: str  # CHAT | COMPLETION
    messages: list[Message] | None = None
    prompt: str | list[int] | None = None  # COMPLETION: text, or token ids
    # (parameter, value, label) for request_params.resolve
    params: list[tuple[str, Any, str]] = field(default_factory=list)
