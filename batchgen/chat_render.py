"""Prompts that come as conversations (chat rows, batch-file requests) or as a completion
prompt, tokenized so that the row's text stays data: a message that spells a special
token (`<|im_end|>`) reaches the model as the ordinary tokens of that text. Only the chat
template and the job's own system prompt put real special tokens in the prompt (the
marking is batchgen/prompt_data.py's, as for template rows)."""

from __future__ import annotations

from batchgen.conversation import Message
from batchgen.prompt_data import MarkedText, RowMarks, reserved_marks, special_token_pattern


class ConversationRenderer:
    """Token ids of a conversation through the model's chat template, or of a completion
    prompt taken as it is."""

    def __init__(self, tokenizer, system: str | None = None):
        self.tokenizer = tokenizer
        self.system = system  # the job's prompt.system: used when a row has none
        self._specials = special_token_pattern(tokenizer.special_tokens)
        self._reserved = reserved_marks(system, getattr(tokenizer, "chat_template", None))

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tokenizer.has_chat_template)

    def conversation_text(self, messages: list[Message]) -> MarkedText:
        """The chat template's text for `messages`, with the spans that are row data."""
        marks = RowMarks.for_row(
            {"messages": [m.content for m in messages]}, self._specials, self._reserved
        )
        turns = []
        if self.system and not any(m.role == "system" for m in messages):
            turns.append({"role": "system", "content": self.system})
        # str(DataStr): the content between its row's marks, with leading and trailing
        # whitespace outside them (a template that trims content trims the bare text).
        turns += [{"role": m.role, "content": str(marks.data(m.content))} for m in messages]
        text = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True)
        return marks.unmark(text)

    def conversation_ids(self, messages: list[Message]) -> list[int]:
        full = self.conversation_text(messages)
        # The chat template already wrote the prompt's BOS and role markers.
        return self.tokenizer.encode_with_data(full.plain, full.spans, add_special_tokens=False)

    def completion_ids(self, prompt: str) -> list[int]:
        """A completion prompt is the row's text, all of it data (BOS as for any plain
        prompt)."""
        return self.tokenizer.encode_with_data(prompt, [(0, len(prompt))], add_special_tokens=True)
