"""Pre-checks for the operations through which a small template makes a huge value.

Each check runs *before* the operation, on operands that already obey the size bound of
`RenderBudget`, and refuses when the result would pass it: repetition (`*`), big-integer
arithmetic (`*`, `**`), printf and `str.format` widths, and the filters and `str` methods
that amplify (center/ljust/zfill widths, indent, replace, join, wordwrap, batch/slice
counts, tojson indentation). Everything else produces at most a constant factor of its
inputs and is checked after the fact by `RenderBudget.measure`. The few pure-Python text
filters that are slow per character (urlize, wordwrap, pprint, title, xmlattr) take
bounded input, since no deadline check can run inside them.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from typing import Any

from engine.errors import TemplateError
from engine.tokenizer.chat_budget import RenderBudget

_MAX_INT_BITS = 1 << 15  # str(int) refuses ~14k bits anyway; keeps bigint math instant
_PRINTF_SPEC = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")
_SEQUENCES = (str, bytes, list, tuple)
SLOW_FILTER_INPUT = 32 * 1024

Data = tuple[Any, ...]
FilterCheck = Callable[[RenderBudget, Data, dict[str, Any]], Data]


def _int_arg_ok(budget: RenderBudget, value: Any, what: str) -> None:
    if isinstance(value, int) and value > budget.max_chars:
        raise budget.too_large(what, value)


# ---- binary operators ------------------------------------------------------------------


def check_binop(budget: RenderBudget, operator: str, left: Any, right: Any) -> None:
    """Refuse `left <operator> right` when its result would be too large to compute."""
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > _MAX_INT_BITS:
                raise TemplateError("chat template computed a power too large to represent")
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                raise TemplateError("chat template computed a product too large to represent")
        elif isinstance(right, int) and isinstance(left, _SEQUENCES) and right > 0:
            budget.check(budget.measure(left) * right, "repeated value")
        elif isinstance(left, int) and isinstance(right, _SEQUENCES) and left > 0:
            budget.check(budget.measure(right) * left, "repeated value")
    elif operator == "+":
        if isinstance(left, _SEQUENCES) and isinstance(right, _SEQUENCES):
            budget.check(budget.measure(left) + budget.measure(right), "concatenation")
    elif operator == "%" and isinstance(left, (str, bytes)):
        check_printf(budget, left if isinstance(left, str) else left.decode("latin-1"), right)


def _widest(budget: RenderBudget, spec: str) -> int:
    """The largest number written in a format spec, refused past the bound."""
    runs = _DIGITS.findall(spec)
    for run in runs:
        if len(run) > 12 or int(run) > budget.max_chars:
            raise budget.too_large("format width", None)
    return max(map(int, runs), default=0)


def _largest_int(budget: RenderBudget, values: Any, what: str) -> int:
    largest = 0
    for value in values:
        if isinstance(value, int):
            if value > budget.max_chars:
                raise budget.too_large(what, value)
            largest = max(largest, value)
    return largest


def check_printf(budget: RenderBudget, fmt: str, args: Any) -> None:
    """`fmt % args`: widths (literal or `*`) and the result stay within the bound. A
    mapping's values can be named by many specs; positional values are used once each."""
    values = args if isinstance(args, tuple) else (args,)
    specs = [group for match in _PRINTF_SPEC.finditer(fmt) for group in match.groups()]
    star = _largest_int(budget, values, "printf width") if "*" in specs else 0
    width = sum(star if group == "*" else _widest(budget, group) for group in specs if group)
    if isinstance(args, Mapping):
        largest = max((budget.measure(v, text=True) for v in args.values()), default=0)
        size = max(budget.measure(args, text=True), len(specs) // 2 * largest)
    else:
        size = sum(budget.measure(value, text=True) for value in values)
    budget.check(len(fmt) + size + width, "printf result")


def check_str_format(budget: RenderBudget, fmt: str, is_map: bool, args: Data,
                     kwargs: dict[str, Any]) -> None:
    """`fmt.format(...)` / `fmt.format_map(m)`: each field adds its argument's size and its
    width; an argument named by many fields counts each time."""
    if is_map:
        mapping = args[0] if args else {}
        args, kwargs = (), mapping if isinstance(mapping, Mapping) else {}
    nested_width = 0  # what a `{:{w}}` width can take
    if any(spec and "{" in spec for _, _, spec, _ in string.Formatter().parse(fmt)):
        nested_width = _largest_int(budget, (*args, *kwargs.values()), "format width")
    sizes: dict[Any, int] = {}
    total, auto = len(fmt), 0
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is None:
            continue
        first = field.split(".", 1)[0].split("[", 1)[0]
        if first == "":
            key: Any = auto
            auto += 1
        else:
            key = int(first) if first.isdigit() else first
        if key not in sizes:
            value = args[key] if isinstance(key, int) and key < len(args) else (
                kwargs.get(key) if isinstance(key, str) else None)
            sizes[key] = budget.measure(value, text=True)
        total += sizes[key]
        if spec:
            total += nested_width if "{" in spec else _widest(budget, spec)
        budget.check(total, "format() result")


# ---- str / bytes methods ---------------------------------------------------------------


def check_replace(budget: RenderBudget, text: Any, old: Any, new: Any, count: Any) -> None:
    occurrences = text.count(old) if len(old) else len(text) + 1
    if isinstance(count, int) and count >= 0:
        occurrences = min(occurrences, count)
    budget.check(len(text) + occurrences * max(0, len(new) - len(old)), "replace() result")


def check_join(budget: RenderBudget, separator: Any, items: list[Any]) -> None:
    size = sum(budget.measure(item, text=True) for item in items)
    budget.check(size + max(0, len(items) - 1) * len(separator), "join() result")


def check_method(budget: RenderBudget, owner: Any, name: str, args: Data, kwargs: dict) -> Data:
    """A builtin method of a str, bytes or int; returns the (maybe materialized) args."""
    for value in (*args, *kwargs.values()):
        _int_arg_ok(budget, value, f"{name}() argument")
    if name in ("translate", "maketrans"):
        raise TemplateError(f"chat template may not call str.{name}()")
    if isinstance(owner, (str, bytes)):
        if name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            tabs = owner.count("\t" if isinstance(owner, str) else b"\t")
            budget.check(len(owner) + tabs * max(0, int(tab)), "expandtabs() result")
        elif name == "replace" and len(args) >= 2:
            count = args[2] if len(args) > 2 else kwargs.get("count", -1)
            check_replace(budget, owner, args[0], args[1], count)
        elif name == "join" and args:
            items = list(args[0])
            check_join(budget, owner, items)
            return (items, *args[1:])
    return args


# ---- filters ---------------------------------------------------------------------------


def _arg(data: Data, kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    return data[index] if len(data) > index else kwargs.get(name, default)


def _as_text(budget: RenderBudget, value: Any) -> str:
    if isinstance(value, str):
        return value
    budget.measure(value, text=True)
    return str(value)


def _width_check(index: int, name: str, default: Any) -> FilterCheck:
    def check(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
        _int_arg_ok(budget, _arg(data, kwargs, index, name, default), f"filter {name}")
        return data

    return check


def _slow(name: str, then: FilterCheck | None = None) -> FilterCheck:
    """Pure-Python text filters cost microseconds per char and cannot check the deadline
    inside; chat templates use them, if ever, on short strings."""

    def check(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
        size = budget.measure(data[0], text=True)
        if size > SLOW_FILTER_INPUT:
            raise TemplateError(
                f"chat template filter {name!r} takes at most {SLOW_FILTER_INPUT} chars, "
                f"got {size}"
            )
        return then(budget, data, kwargs) if then is not None else data

    return check


def _chars(name: str) -> FilterCheck:
    """A string turned into a list of characters grows fivefold in tree size."""

    def check(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
        if isinstance(data[0], str):
            budget.check(5 * len(data[0]) + 2, f"{name} of a string")
        return data

    return check


def _indent(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
    text = _as_text(budget, data[0])
    width = _arg(data, kwargs, 1, "width", 4)
    unit = width if isinstance(width, int) else len(_as_text(budget, width))
    budget.check(len(text) + (text.count("\n") + 1) * max(0, unit), "indent result")
    return data


def _replace(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
    old = _as_text(budget, _arg(data, kwargs, 1, "old", ""))
    new = _as_text(budget, _arg(data, kwargs, 2, "new", ""))
    check_replace(budget, _as_text(budget, data[0]), old, new, _arg(data, kwargs, 3, "count", -1))
    return data


def _join(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
    items = list(data[0])
    check_join(budget, _as_text(budget, _arg(data, kwargs, 1, "d", "")), items)
    return (items, *data[1:])


def _format(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
    check_printf(budget, _as_text(budget, data[0]), tuple(data[1:]) or kwargs)
    return data


def _wordwrap(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
    text = _as_text(budget, data[0])
    width = _arg(data, kwargs, 1, "width", 79)
    wrap = _arg(data, kwargs, 3, "wrapstring", None)
    # Lines break at whitespace or, for long words, every `width` characters.
    breaks = sum(map(text.count, " \t\n")) + len(text) // max(1, int(width)) + 1
    budget.check(len(text) + breaks * len(_as_text(budget, wrap or "\n")), "wordwrap result")
    return data


def _tojson(budget: RenderBudget, data: Data, kwargs: dict[str, Any]) -> Data:
    indent = _arg(data, kwargs, 2, "indent", None)
    separators = _arg(data, kwargs, 3, "separators", None) or ()
    unit = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    extra = sum(len(_as_text(budget, s)) for s in separators)
    budget.measure(data[0], text=True, indent=max(0, unit) + extra)
    return data


FILTER_CHECKS: dict[str, FilterCheck] = {
    "center": _width_check(1, "width", 80),
    "batch": _width_check(1, "linecount", 0),
    "slice": _width_check(1, "slices", 0),
    "truncate": _width_check(1, "length", 255),
    "indent": _indent,
    "replace": _replace,
    "join": _join,
    "format": _format,
    "wordwrap": _slow("wordwrap", _wordwrap),
    "tojson": _tojson,
    "urlize": _slow("urlize"),
    "pprint": _slow("pprint"),
    "title": _slow("title"),
    "xmlattr": _slow("xmlattr"),
    "list": _chars("list"),
    "sort": _chars("sort"),
    "unique": _chars("unique"),
}

# Filters that turn their input into text: their arguments must be data, never objects.
TEXT_FILTERS = frozenset(
    {"center", "truncate", "indent", "replace", "join", "format", "wordwrap", "tojson"}
    | {"string", "e", "escape", "forceescape", "lower", "upper", "title", "capitalize"}
    | {"trim", "striptags", "urlize", "urlencode", "pprint", "safe", "wordcount", "xmlattr"}
)
