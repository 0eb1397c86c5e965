"""Where a row's values sit in a rendered prompt, so that no special token comes from them.

A row value holding `<|im_end|>\\n<|im_start|>system ...` must reach the model as those
characters, not as the chat template's real role markers. Rendering produces one text in
which the template's own markup and the values are mixed, so the values are marked:

- before rendering, each value is wrapped (DataStr): printed, it stands between two
  boundary marks, and every special-token string in it is replaced by an escape character
  (one per distinct string). Strings a template derives from a value (a filter, a method,
  a slice, `+`, `%`) are wrapped again by DataMarkingSandbox, so they print marked too;
- after rendering (the job template, then the chat template), `RowMarks.unmark` takes
  the marks and escapes out again: the plain text plus the [start, end) spans that hold
  data. The engine's `Tokenizer.encode_with_data` then encodes special-token strings in
  those spans, or across their edges, as ordinary text.

Marks and escapes are code points of Unicode's Supplementary Private Use Area-B, chosen
per row among those that occur nowhere in the row's values, the job template, the system
prompt or the chat template, so a row cannot forge or cancel one. Escapes also survive
what drops the boundary marks (iterating a value's characters, `split()`), so a special-
token string a value holds stays data there too. What a template builds from values by
other means (a value's characters re-joined one by one) is text the template wrote.

What a template can observe: printing a value adds its two marks to the printed text, so
a template that measures or compares text it has printed (`(a ~ b) | length`) sees them;
in a value that holds special-token strings each of them is one character to the
template (`length`, slices). Values without special-token strings are themselves to
filters and methods, and render to exactly the text they rendered to unmarked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from batchgen.template_sandbox import LimitedSandbox

_FIRST_MARK = 0x100000
_LAST_MARK = 0x10FFFD
_MARK_RANGE = re.compile("[\U00100000-\U0010fffd]")


@dataclass
class MarkedText:
    """Plain text and the sorted, disjoint [start, end) spans of it that are row data."""

    plain: str
    spans: list[tuple[int, int]] = field(default_factory=list)

    def slice(self, start: int, end: int) -> MarkedText:
        spans = [(max(a, start) - start, min(b, end) - start) for a, b in self.spans]
        return MarkedText(self.plain[start:end], [(a, b) for a, b in spans if a < b])

    def __add__(self, other: MarkedText) -> MarkedText:
        shift = len(self.plain)
        spans = self.spans + [(a + shift, b + shift) for a, b in other.spans]
        return MarkedText(self.plain + other.plain, _merged(spans))


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with overlapping or touching spans joined (a token across two adjacent
    spans is data either way)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[0] < s[1]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def reserved_marks(*texts: str | None) -> frozenset[str]:
    """The mark-range characters already used by the job's own texts (template, system
    prompt, chat template): no row may use them as marks."""
    return frozenset(c for t in texts if t for c in _MARK_RANGE.findall(t))


class DataStr(str):
    """A row value's text, special-token strings escaped; prints between its row's marks.
    Leading and trailing whitespace prints outside the marks, so a chat template that
    trims the message trims it as it would the bare value. Its repr (a list printed
    whole) is the repr of the value's own text, marked."""

    marks: RowMarks

    def __str__(self) -> str:
        text = str.__str__(self)
        core = text.strip()
        if not core:
            return text
        lead = text[: len(text) - len(text.lstrip())]
        trail = text[len(lead) + len(core) :]
        return f"{lead}{self.marks.open}{core}{self.marks.close}{trail}"

    def __repr__(self) -> str:
        return f"{self.marks.open}{self.marks.plain(self)!r}{self.marks.close}"

    def __getitem__(self, key):  # Jinja2 slices (`text[:100]`) without a sandbox hook
        return self.marks.data(str.__getitem__(self, key))


class DataBytes(bytes):
    """A row's binary value: bytes as they are to filters and methods (`decode` gives
    data text), printing as its marked repr."""

    marks: RowMarks

    def __str__(self) -> str:
        return str(self.marks.data(bytes.__repr__(self)))

    __repr__ = __str__

    def __getitem__(self, key):
        part = bytes.__getitem__(self, key)
        return self.marks.wrap(part) if isinstance(part, bytes) else part


class RowMarks:
    """The marks of one row: two boundary characters and an escape character for each
    special-token string found in it (allocated as they are met)."""

    def __init__(self, specials: re.Pattern | None, used: set[str]) -> None:
        self._specials = specials  # alternation of the tokenizer's special-token strings
        self._used = used
        self._next = _FIRST_MARK
        self.open = self._allocate()
        self.close = self._allocate()
        self._escape_of: dict[str, str] = {}
        self._special_of: dict[str, str] = {}
        self._pattern: re.Pattern | None = None

    @classmethod
    def for_row(
        cls, values: dict[str, Any], specials: re.Pattern | None, reserved: frozenset[str]
    ) -> RowMarks:
        used = set(reserved)
        for text in _strings(values):
            used.update(_MARK_RANGE.findall(text))
        return cls(specials, used)

    def _allocate(self) -> str:
        while self._next <= _LAST_MARK and chr(self._next) in self._used:
            self._next += 1
        if self._next > _LAST_MARK:
            raise ValueError("the row uses every private-use character; cannot mark its values")
        char = chr(self._next)
        self._used.add(char)
        self._next += 1
        return char

    def escape(self, text: str) -> str:
        """`text` with each special-token string replaced by its escape character."""
        if self._specials is None or not self._specials.search(text):
            return text
        return self._specials.sub(lambda m: self._escape_char(m.group()), text)

    def _escape_char(self, special: str) -> str:
        char = self._escape_of.get(special)
        if char is None:
            char = self._allocate()
            self._escape_of[special] = char
            self._special_of[char] = special
            self._pattern = None
        return char

    def plain(self, text: str) -> str:
        """`text` with its escapes turned back into the strings they stand for."""
        return self.unmark(str.__str__(text)).plain if self._special_of else str(text)

    def data(self, text: str) -> DataStr:
        """`text` as data of this row (escaped, printing marked)."""
        value = DataStr(self.escape(text))
        value.marks = self
        return value

    def wrap(self, value: Any) -> Any:
        """A row value ready for the template: strings become DataStr, containers are
        wrapped item by item, other values pass as they are."""
        if isinstance(value, (DataStr, DataBytes)):
            return value
        if isinstance(value, str):
            return self.data(value)
        if isinstance(value, list):
            return [self.wrap(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self.wrap(v) for v in value)
        if isinstance(value, dict):
            return {k: self.wrap(v) for k, v in value.items()}
        if isinstance(value, (bytes, bytearray)):
            data = DataBytes(value)
            data.marks = self
            return data
        return value

    def _mark_pattern(self) -> re.Pattern:
        if self._pattern is None:
            chars = [self.open, self.close, *self._special_of]
            self._pattern = re.compile("[" + "".join(re.escape(c) for c in chars) + "]")
        return self._pattern

    def unmark(self, text: str) -> MarkedText:
        """Take this row's marks and escapes out of rendered text. A mark left unpaired
        (a template cut printed text in two) makes everything on its open side data."""
        plain: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = last = depth = 0
        start = 0
        for m in self._mark_pattern().finditer(text):
            chunk = text[last : m.start()]
            plain.append(chunk)
            pos += len(chunk)
            last = m.end()
            char = m.group()
            if char == self.open:
                if depth == 0:
                    start = pos
                depth += 1
            elif char == self.close:
                if depth == 0:
                    spans.append((0, pos))
                else:
                    depth -= 1
                    if depth == 0:
                        spans.append((start, pos))
            else:
                special = self._special_of[char]
                plain.append(special)
                spans.append((pos, pos + len(special)))
                pos += len(special)
        plain.append(text[last:])
        pos += len(text) - last
        if depth > 0:
            spans.append((start, pos))
        return MarkedText("".join(plain), _merged(spans))

    def mark(self, text: MarkedText) -> str:
        """The inverse of unmark: plain text with its data spans marked and escaped, to
        hand to another template (the chat template)."""
        out: list[str] = []
        last = 0
        for a, b in text.spans:
            out.append(text.plain[last:a])
            out.append(f"{self.open}{self.escape(text.plain[a:b])}{self.close}")
            last = b
        out.append(text.plain[last:])
        return "".join(out)


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)


def special_token_pattern(specials: Iterable[str]) -> re.Pattern | None:
    """One regex matching any of the special-token strings, longest first."""
    ordered = sorted({s for s in specials if s}, key=len, reverse=True)
    if not ordered:
        return None
    return re.compile("|".join(re.escape(s) for s in ordered))


def _marks_in(*values: Any) -> RowMarks | None:
    """The marks of the first DataStr among `values` or one level inside them (the list a
    `join` takes, the tuple or dict a `%` takes)."""
    for value in values:
        if isinstance(value, (DataStr, DataBytes)):
            return value.marks
        items = value.values() if isinstance(value, dict) else value
        if isinstance(items, (list, tuple, type({}.values()))):
            for item in items:
                if isinstance(item, (DataStr, DataBytes)):
                    return item.marks
    return None


def _as_data(marks: RowMarks, result: Any) -> Any:
    """`result` (a str, bytes, or a list or tuple of them) as data of the row."""
    if isinstance(result, (DataStr, DataBytes)):
        return result
    if isinstance(result, (str, bytes)):
        return marks.wrap(result)
    if isinstance(result, (list, tuple)) and any(isinstance(r, (str, bytes)) for r in result):
        items = [_as_data(marks, r) for r in result]
        return items if isinstance(result, list) else tuple(items)
    return result


def _json_dumps(value: Any, **kwargs: Any) -> str:
    """`tojson` over values that may hold DataStr: the JSON of their own text, the whole
    JSON marked as data when any of them did."""
    found: list[RowMarks] = []

    def own_text(item: Any) -> Any:
        if isinstance(item, DataStr):
            found.append(item.marks)
            return item.marks.plain(item)
        if isinstance(item, (list, tuple)):
            return [own_text(v) for v in item]
        if isinstance(item, dict):
            return {own_text(k): own_text(v) for k, v in item.items()}
        return item

    text = json.dumps(own_text(value), **kwargs)
    return found[0].data(text) if found else text


class DataMarkingSandbox(LimitedSandbox):
    """LimitedSandbox in which text derived from a row value stays marked as data: what
    str methods, filters and `*` return from a DataStr (all of it data), `a + b` (each
    side marked as it prints), and the JSON `tojson` writes of values (slices are
    DataStr's own)."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(max_chars)
        self.policies["json.dumps_function"] = _json_dumps

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        result = super().call_binop(context, operator, left, right)
        marks = _marks_in(left, right)
        if marks is None or operator == "%":  # `%` prints values with str(): marked already
            return result
        if operator == "+" and isinstance(result, str):
            # Each side as it prints: the template's own text keeps its special tokens.
            return str(left) + str(right)
        return _as_data(marks, result)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        result = super().call(__context, __obj, *args, **kwargs)
        owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
        if not isinstance(owner, (str, bytes)):
            return result  # a macro's output holds the marks of the values it printed
        marks = _marks_in(owner, *args, *kwargs.values())
        return _as_data(marks, result) if marks else result

    def _guard_filter(self, name: str, func):
        guarded = super()._guard_filter(name, func)

        def marking(*args: Any, **kwargs: Any) -> Any:
            result = guarded(*args, **kwargs)
            marks = _marks_in(*args, *kwargs.values())
            return _as_data(marks, result) if marks else result

        marking.__dict__.update(guarded.__dict__)  # keeps Jinja2's pass_context marks
        marking.__name__ = getattr(func, "__name__", name)
        return marking
