"""The Jinja2 sandbox prompt templates run in, with limits on what one render may build.

Jinja2's sandbox stops a template from reaching Python internals, but not from building a
huge string (`{{ 'x' * 100000000 }}`), a huge range, or a loop that runs for minutes. Here
every way a template can grow its output or its running time is bounded per render:

- the rendered text: streamed chunk by chunk and stopped at `max_chars`;
- each operation that can multiply a size (`*`, `+`, `~`, `%`, `**`, the string methods
  and filters that pad, repeat, replace or join) is checked before it runs, against the
  same `max_chars`, so nothing larger is ever allocated;
- `range()` gives at most MAX_RANGE items; loop iterations, calls and printed
  expressions together are at most MAX_STEPS per render (bounding time: a template cannot
  nest loops or recurse macros into minutes of work);
- lists, dicts and sets cannot be changed in place (Jinja2's immutable sandbox), and
  `lipsum` is not offered.

A template that passes a limit raises TemplateLimitError (a SecurityError, so every caller
that already turns sandbox refusals into error rows handles it too).
"""

from __future__ import annotations

import contextvars
import re
import string
from collections.abc import Iterable, Iterator
from functools import wraps
from itertools import islice
from typing import Any

from jinja2 import Environment, StrictUndefined, nodes, pass_context
from jinja2.exceptions import SecurityError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RANGE = 10_000
MAX_STEPS = 100_000
# Integers past this many bits (about 20,000 digits) are refused: `9 ** 9 ** 9` would take
# minutes to compute, and a prompt never needs one.
MAX_INT_BITS = 65_536
_LOOP_FILTER = "__batchgen_counted_loop"
_CONCAT_FILTER = "__batchgen_bounded_concat"
# Width and precision of one %-directive: %(name)-10.5s -> "10", "5"; "*" takes them from
# the arguments, which this check cannot see, so it is refused.
_PERCENT_DIRECTIVE = re.compile(
    r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?([diouxXeEfFgGcrsa%])"
)
_NUMBER = re.compile(r"\d+")
# Filters whose integer arguments size what they allocate (a width, a count of items).
_INT_SIZED_FILTERS = frozenset({"center", "indent", "batch", "slice", "tojson"})


class TemplateLimitError(SecurityError):
    """A template passed one of the render limits (length, range, steps)."""


class _Budget:
    """What one render has used so far."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self.steps = 0
        self.printed = 0  # characters of printed expressions, captured blocks included

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise TemplateLimitError(
                f"template limit: more than {MAX_STEPS:,} loop iterations, calls and "
                "printed expressions in one row"
            )


_current: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "template_budget", default=None
)


def size_of(value: Any, limit: int) -> int:
    """About how many characters `value` prints as; counting stops once past `limit`, so
    a structure of shared references costs at most `limit` steps however large it
    prints."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (str, bytes, bytearray)):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + 2 * len(item)  # brackets and ", " separators
            stack.extend(islice(item, limit))
        elif isinstance(item, dict):
            total += 2 + 4 * len(item)  # braces, ": " and ", "
            stack.extend(islice(item.keys(), limit))
            stack.extend(islice(item.values(), limit))
        elif isinstance(item, range):
            total += 8 * len(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += item.bit_length() // 3 + 1
        else:
            total += 8
        if total > limit:
            return total
    return total


def _refuse_size(what: str, size: int, limit: int) -> None:
    if size > limit:
        raise TemplateLimitError(
            f"template limit: {what} would be about {size:,} characters; a prompt "
            f"may be at most {limit:,}"
        )


def _refuse_bits(bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateLimitError(f"template limit: an integer of over {MAX_INT_BITS:,} bits")


def _percent_bound(fmt: str, args: Any, limit: int) -> int:
    """An upper bound on the length of `fmt % args`."""
    directives = 0
    widths = 0
    for width, precision, _ in _PERCENT_DIRECTIVE.findall(fmt):
        if "*" in (width, precision):
            raise TemplateLimitError("template limit: '*' widths in %-formatting are refused")
        directives += 1
        widths += int(width or 0) + int(precision or 0)
    return len(fmt) + widths + directives * size_of(args, limit)


def _format_bound(fmt: str, args: Any, limit: int) -> int:
    """An upper bound on the length of `fmt.format(*args, **kwargs)`."""
    fields = 0
    widths = 0
    for _, name, spec, _ in string.Formatter().parse(fmt):
        if name is None:
            continue
        if spec and "{" in spec:
            raise TemplateLimitError(
                "template limit: nested replacement fields in a format spec are refused"
            )
        fields += 1
        widths += sum(int(n) for n in _NUMBER.findall(spec or ""))
    return len(fmt) + widths + fields * size_of(args, limit)


def _replace_bound(text: str, old: str, new: str, count: int = -1) -> int:
    found = text.count(old) if old else len(text) + 1
    if count is not None and count >= 0:
        found = min(found, count)
    return len(text) + found * max(len(new) - len(old), 0)


def _join_bound(separator: str, items: list, limit: int) -> int:
    return size_of(items, limit) + len(separator) * max(len(items) - 1, 0)


class LimitedSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox with the limits in the module docstring. `max_chars`
    caps one render's text and anything a template builds on the way."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def __init__(self, max_chars: int) -> None:
        super().__init__(
            undefined=StrictUndefined,
            autoescape=False,
            keep_trailing_newline=True,
            finalize=self._finalize,
        )
        self.max_chars = max_chars
        self.globals["range"] = self._range
        self.globals.pop("lipsum", None)
        for name, func in list(self.filters.items()):
            self.filters[name] = self._guard_filter(name, func)
        self.filters[_LOOP_FILTER] = _counted_loop
        self.filters[_CONCAT_FILTER] = _bounded_concat

    # -- compiling ------------------------------------------------------------------
    def compile_limited(self, source: str):
        """The template, with every loop counted and every `~` checked. (Jinja2 compiles
        `~` and `for` to plain Python with no sandbox hook, so the parsed tree is
        rewritten to route them through two internal filters.)"""
        tree = self.parse(source)
        for loop in tree.find_all(nodes.For):
            loop.iter = nodes.Filter(
                loop.iter, _LOOP_FILTER, [], [], None, None, lineno=loop.lineno
            )
        for concat in list(tree.find_all(nodes.Concat)):
            parts = nodes.List(list(concat.nodes), lineno=concat.lineno)
            concat.nodes = [
                nodes.Filter(parts, _CONCAT_FILTER, [], [], None, None, lineno=concat.lineno)
            ]
        return self.from_string(tree)

    def render_limited(self, template, values: dict[str, Any], max_chars: int) -> str:
        """Render over `values`, streaming: stop as soon as the text passes `max_chars`."""
        budget = _Budget(max_chars)
        token = _current.set(budget)
        try:
            chunks: list[str] = []
            length = 0
            for chunk in template.generate(**values):
                length += len(chunk)
                if length > max_chars:
                    raise TemplateLimitError(
                        f"template limit: the rendered prompt passes {max_chars:,} characters"
                    )
                chunks.append(chunk)
            return "".join(chunks)
        finally:
            _current.reset(token)

    # -- limits ---------------------------------------------------------------------
    def _limit(self) -> int:
        budget = _current.get()
        return budget.max_chars if budget is not None else self.max_chars

    def _step(self) -> None:
        budget = _current.get()
        if budget is not None:
            budget.step()

    def _finalize(self, value: Any) -> Any:
        """Runs on every printed expression, inside captured blocks and macros too."""
        budget = _current.get()
        if budget is None:  # a constant folded at compile time: bounded by the source
            return value
        budget.step()
        budget.printed += size_of(value, budget.max_chars)
        # Captured blocks print into buffers that the text stream never sees; printing
        # more than a few times the cap in all is a template building something huge.
        _refuse_size("the printed expressions", budget.printed, 4 * budget.max_chars)
        return value

    def _range(self, *args: int) -> range:
        self._step()
        items = range(*args)
        if len(items) > MAX_RANGE:
            raise TemplateLimitError(
                f"template limit: range() of {len(items):,} items; at most {MAX_RANGE:,}"
            )
        return items

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        limit = self._limit()
        sized = (str, bytes, list, tuple)
        if operator == "*":
            if isinstance(left, int) and isinstance(right, sized):
                left, right = right, left
            if isinstance(left, sized) and isinstance(right, int) and right > 0:
                _refuse_size("'*'", size_of(left, limit) * right, limit)
            elif isinstance(left, int) and isinstance(right, int):
                _refuse_bits(left.bit_length() + right.bit_length())
        elif operator == "+":
            if isinstance(left, sized) and isinstance(right, sized):
                _refuse_size("'+'", size_of(left, limit) + size_of(right, limit), limit)
        elif operator == "%":
            if isinstance(left, str):
                _refuse_size("'%'", _percent_bound(left, right, limit), limit)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            _refuse_bits(left.bit_length() * right if abs(left) > 1 else 0)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self._step()
        limit = __self._limit()
        target = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
        owner = getattr(target, "__self__", None)
        if isinstance(owner, str):
            name = getattr(target, "__name__", "")
            if name == "join" and args:
                items = list(args[0])
                _refuse_size("join()", _join_bound(owner, items, limit), limit)
                args = (items, *args[1:])
            else:
                _refuse_size(f"{name}()", _method_bound(owner, name, args, kwargs, limit), limit)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, (str, bytes, list, tuple, dict)):
            _refuse_size("a call's result", size_of(result, limit), limit)
        return result

    def _guard_filter(self, name: str, func):
        env = self

        @wraps(func)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            limit = env._limit()
            plain = [a for a in args if not _is_jinja_state(a)]
            sized_by = [*plain[1:], *kwargs.values()] if name in _INT_SIZED_FILTERS else []
            for arg in sized_by:
                if isinstance(arg, int) and not isinstance(arg, bool) and arg > limit:
                    raise TemplateLimitError(
                        f"template limit: {name}({arg:,}) is over the {limit:,}-character cap"
                    )
            if plain:
                _refuse_size(f"'{name}'", _filter_bound(name, plain, kwargs, limit), limit)
            result = func(*args, **kwargs)
            if isinstance(result, (str, bytes, list, tuple, dict)):
                _refuse_size(f"'{name}'", size_of(result, limit), limit)
            return result

        return guarded


def _is_jinja_state(arg: Any) -> bool:
    """The context, eval context or environment Jinja2 passes to some filters first."""
    return isinstance(arg, (Context, EvalContext, Environment))


def _method_bound(text: str, name: str, args: tuple, kwargs: dict, limit: int) -> int:
    """An upper bound on the length a str method returns, for the ones that can grow."""
    if name in ("ljust", "rjust", "center", "zfill"):
        width = args[0] if args else kwargs.get("width", 0)
        return max(len(text), width if isinstance(width, int) else 0)
    if name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        return len(text) + text.count("\t") * (size if isinstance(size, int) else 8)
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        return _replace_bound(text, args[0], args[1], count if isinstance(count, int) else -1)
    if name in ("format", "format_map"):
        return _format_bound(text, (args, kwargs), limit)
    if name == "translate" and args:
        table = args[0]
        values = table.values() if isinstance(table, dict) else ()
        longest = max((size_of(v, limit) for v in values), default=1)
        return len(text) * max(longest, 1)
    return len(text)


def _filter_bound(name: str, args: list, kwargs: dict, limit: int) -> int:
    """An upper bound on what the filters that can amplify their input return."""
    value = args[0]
    rest = args[1:]
    if name == "replace" and isinstance(value, str) and len(rest) >= 2:
        count = rest[2] if len(rest) > 2 else kwargs.get("count")
        return _replace_bound(value, str(rest[0]), str(rest[1]), count if count else -1)
    if name == "indent":
        width = rest[0] if rest else kwargs.get("width", 4)
        text = str(value) if isinstance(value, str) else ""
        pad = len(width) if isinstance(width, str) else int(width or 0)
        return len(text) + (text.count("\n") + 1) * pad
    if name == "wordwrap" and isinstance(value, str):
        width = rest[0] if rest else kwargs.get("width", 79)
        wrap = rest[2] if len(rest) > 2 else kwargs.get("wrapstring") or "\n"
        lines = len(value) // max(int(width or 1), 1) + 1
        return len(value) + lines * len(str(wrap))
    if name == "join":
        separator = rest[0] if rest else kwargs.get("d", "")
        items = value if isinstance(value, (list, tuple)) else []
        return _join_bound(str(separator), items, limit)
    if name == "format" and isinstance(value, str):
        return _percent_bound(value, (rest, kwargs), limit)
    if name in ("tojson", "pprint", "urlencode", "xmlattr", "string", "sum"):
        indent = rest[0] if rest and isinstance(rest[0], int) else kwargs.get("indent") or 0
        return size_of(value, limit) * (3 + int(indent))
    return 0


@pass_context
def _counted_loop(context, iterable: Iterable) -> Iterator:
    """The iterable of a `for` loop, counting each item against the render's steps.
    (pass_context keeps Jinja2 from calling it at compile time on a constant list.)"""
    budget = _current.get()
    for item in iterable:
        if budget is not None:
            budget.step()
        yield item


@pass_context
def _bounded_concat(context, parts: list) -> str:
    """`a ~ b ~ ...`, refused before joining when the result would pass the cap."""
    budget = _current.get()
    if budget is not None:
        _refuse_size("'~'", size_of(parts, budget.max_chars), budget.max_chars)
    return str_join(parts)
