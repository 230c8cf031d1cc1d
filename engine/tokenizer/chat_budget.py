"""The time and size allowance of one chat-template render, and the size checks on values.

A `RenderBudget` is made per render and reached by every sandbox hook through a ContextVar
(renders on different threads never share one). Two invariants keep a hostile template
bounded:

- time: every hook (call, attribute, item, filter, test, loop iteration, output part)
  calls `tick()`, which raises once the deadline has passed and keeps raising after;
- size: every value the template makes (literals, operator results, filter and call
  results) has a *tree size* of at most `max_chars`, checked when it is made, before any
  operation that could amplify it runs. The tree size counts a shared child once per
  reference, so `[x, x]` doubled in a loop cannot build an exponentially large value
  behind a small object graph; it approximates the length of `str(value)` / `tojson`.

Single C-level operations (a sort, a join) cannot be interrupted, but every one of them
works on values that obey the size bound, so none can run long.
"""

from __future__ import annotations

import time
from collections.abc import ItemsView, KeysView, ValuesView
from contextvars import ContextVar
from itertools import chain
from typing import Any

from jinja2.runtime import Undefined
from jinja2.utils import Namespace

from engine.errors import TemplateError

_CURRENT: ContextVar[RenderBudget | None] = ContextVar("mbufo_chat_budget", default=None)

# Values that may appear in rendered text; anything else (classes, functions, modules,
# template internals) is refused by the text-mode walk, so no object repr leaks out.
_TEXT_LEAVES = (str, int, float, bool, type(None), bytes, range, Undefined)
_CONTAINERS = (list, tuple, dict, set, frozenset, Namespace, KeysView, ValuesView, ItemsView)
# Exact-type sets first: isinstance() against the ABCs above is slow on the hot path.
_PLAIN_CONTAINERS = frozenset({list, tuple, dict})
_PLAIN_SCALARS = frozenset({str, int, float, bool, type(None)})
_SMALL_SCALARS = frozenset({float, bool, type(None)})
BUFFER_FACTOR = 8  # buffered text allowed per char of output allowance
_OPAQUE_SIZE = 64  # what an object that is not data counts for outside text mode
_TICK_EVERY = 4096  # values walked between two deadline checks


class RenderBudget:
    """Deadline, size bound and the memo of tree sizes of one render."""

    __slots__ = ("time_limit_s", "deadline", "max_chars", "buffered", "_memo", "_memo_chars",
                 "_steps")

    def __init__(self, time_limit_s: float, max_chars: int) -> None:
        self.time_limit_s = time_limit_s
        self.deadline = time.perf_counter() + time_limit_s
        self.max_chars = max_chars
        self.buffered = 0  # chars written into macro and block buffers, all of them together
        # id -> (object, size, textual); the object is kept so its id cannot be reused.
        self._memo: dict[int, tuple[Any, int, bool]] = {}
        self._memo_chars = 0  # what the memo keeps alive, so that it can be let go
        self._steps = 0

    def tick(self) -> None:
        if time.perf_counter() > self.deadline:
            raise TemplateError(
                f"chat template exceeded its time limit of {self.time_limit_s:g} s"
            )

    def spend_buffer(self, size: int) -> None:
        """Buffers hold text until their macro or block returns; bounding their sum bounds
        the memory a render holds (nested macros count their text once per level)."""
        self.buffered += size
        if self.buffered > BUFFER_FACTOR * self.max_chars:
            raise self.too_large("buffered output", self.buffered)

    def too_large(self, what: str, size: int | None = None) -> TemplateError:
        got = "" if size is None else f" ({size} chars)"
        return TemplateError(
            f"chat template {what} exceeds the size limit of {self.max_chars} chars{got}"
        )

    def check(self, size: int, what: str) -> None:
        if size > self.max_chars:
            raise self.too_large(what, size)

    def measure(self, value: Any, *, text: bool = False, indent: int = 0) -> int:
        """Tree size of `value`, raising once it passes the bound.

        `text=True` also refuses objects that have no business in a prompt (a class, a
        function, a module); `indent` adds JSON indentation per nesting level.
        """
        if type(value) is str:
            return len(value)
        if _is_container(value):
            size, _, textual = self._walk(value, 0, indent)
        else:
            size, textual = _leaf(value)
        if text and not textual:
            raise TemplateError("chat template tried to render a Python object as text")
        return size

    def _walk(self, value: Any, depth: int, indent: int) -> tuple[int, bool, bool]:
        """(size, pure, textual). Pure values hold no Namespace, the one mutable container
        a template has; only they are memoized, since only they cannot grow later."""
        if not indent:
            hit = self._memo.get(id(value))
            if hit is not None:
                return hit[1], True, hit[2]
        if isinstance(value, Namespace):
            parts: Any = chain.from_iterable(
                object.__getattribute__(value, "_Namespace__attrs").items()
            )
        elif isinstance(value, dict):
            parts = chain.from_iterable(value.items())
        elif isinstance(value, ItemsView):
            parts = chain.from_iterable(value)
        else:
            parts = value
        pure, textual = not isinstance(value, Namespace), True
        overhead = 4 + indent * (depth + 1)  # quotes, separator, JSON indentation
        total = 2
        for part in parts:
            self._steps += 1
            if self._steps % _TICK_EVERY == 0:
                self.tick()
            kind = type(part)
            if kind is str:
                total += len(part) + overhead
            elif kind is int:
                total += part.bit_length() // 3 + overhead
            elif kind in _SMALL_SCALARS:
                total += 8 + overhead
            elif _is_container(part):
                size, child_pure, child_textual = self._walk(part, depth + 1, indent)
                total += size + overhead
                pure, textual = pure and child_pure, textual and child_textual
            else:
                size, child_textual = _leaf(part)
                total += size + overhead
                textual = textual and child_textual
            if total > self.max_chars:
                raise self.too_large("value", total)
        if pure and not indent:
            self._remember(value, total, textual)
        return total, pure, textual

    def _remember(self, value: Any, size: int, textual: bool) -> None:
        # The memo holds its containers alive (their ids must stay unique); past a bound
        # it starts over, which only costs re-walking.
        self._memo_chars += size
        if self._memo_chars > BUFFER_FACTOR * self.max_chars:
            self._memo.clear()
            self._memo_chars = size
        self._memo[id(value)] = (value, size, textual)


def _is_container(value: Any) -> bool:
    kind = type(value)
    return kind in _PLAIN_CONTAINERS or (
        kind not in _PLAIN_SCALARS and isinstance(value, _CONTAINERS)
    )


def _leaf(value: Any) -> tuple[int, bool]:
    """(size, textual) of a value that is not a container."""
    if isinstance(value, (str, bytes)):
        return len(value) + 2, True
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return 8, True
    if isinstance(value, int):
        return value.bit_length() // 3 + 2, True
    return _OPAQUE_SIZE, isinstance(value, _TEXT_LEAVES)


def current_budget() -> RenderBudget:
    """The budget of the render in progress; hooks called outside a render refuse to run,
    which also keeps jinja's compile-time constant folding from calling them."""
    budget = _CURRENT.get()
    if budget is None:
        raise TemplateError("chat template code ran outside a bounded render")
    return budget


def activate(budget: RenderBudget) -> Any:
    return _CURRENT.set(budget)


def deactivate(token: Any) -> None:
    _CURRENT.reset(token)
