"""The jinja2 environment chat templates run in: immutable sandbox plus render limits.

Templates come from model files, so a template is untrusted code. jinja2's
`ImmutableSandboxedEnvironment` already denies attribute escapes (`__class__`,
`__globals__` ...) and mutation of lists and dicts; this subclass adds what the sandbox
lacks, a bound on time and size, enforced from *inside* the render:

- the compiled code calls back into the environment at every step a template can
  repeat: calls (functions, methods, macros), attribute and item access, filters, tests,
  binary operators (`+ * ** %` are intercepted), output parts, and every loop iteration
  (the code generator wraps each `for` iterable in a ticking iterator, makes macro and
  block buffers counting lists, and routes literals and `~` through size checks);
- each callback checks the render's deadline (`RenderBudget.tick`, a `perf_counter()`
  read) and the size of what it makes (`chat_budget`, `chat_guards`).

Why not the alternatives: jinja cannot be interrupted from another thread; a tracing
hook (`sys.settrace`) slows every render tenfold and is process-global; a subprocess per
render costs milliseconds and a worker pool brings its own lifecycle. The callbacks
add microseconds to a normal render and stop a runaway one at the next loop iteration
or call. What no callback can interrupt is a single C-level operation, and the size
bound keeps every such operation on bounded values (the few slow pure-Python filters take
bounded input). Memory follows: every value obeys the size bound, macro and block buffers
together hold at most `BUFFER_FACTOR` times it, and the size memo lets go past that too.

Unsafe attribute access raises at once (the stock sandbox returns a silent undefined),
and templates may not extend, include or import other templates (there is no loader).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from functools import wraps
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from engine.errors import TemplateError
from engine.tokenizer import chat_guards
from engine.tokenizer.chat_budget import RenderBudget, activate, current_budget, deactivate

# 3.1.5 and 3.1.6 closed sandbox escapes through str.format and the attr filter; the
# format checks below hook `wrap_str_format`, which 3.1.5 introduced.
if tuple(int(part) for part in jinja2.__version__.split(".")[:3]) < (3, 1, 6):
    raise ImportError(f"chat templates need jinja2 >= 3.1.6, found {jinja2.__version__}")

MAX_SOURCE_CHARS = 256 * 1024  # real templates are under 20 KB; compiling is not free
_FORBIDDEN_TAGS = {
    nodes.Extends: "extends",
    nodes.Include: "include",
    nodes.Import: "import",
    nodes.FromImport: "from ... import",
}


class _BoundedCodeGenerator(CodeGenerator):
    """Routes loop iterables, container literals and `~` through the environment."""

    def buffer(self, frame: Frame) -> None:
        frame.buffer = self.temporary_identifier()
        self.writeline(f"{frame.buffer} = environment.mbufo_buffer()")

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        iterable = nodes.Call(
            nodes.EnvironmentAttribute("mbufo_iter"), [node.iter], [], None, None,
            lineno=node.lineno,
        )
        guarded = nodes.For(
            node.target, iterable, node.body, node.else_, node.test, node.recursive,
            lineno=node.lineno,
        )
        super().visit_For(guarded, frame)

    def _made(self, visit: Callable[[Any, Frame], None], node: nodes.Node, frame: Frame) -> None:
        self.write("environment.mbufo_value(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._made(super().visit_List, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._made(super().visit_Dict, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx == "load":
            self._made(super().visit_Tuple, node, frame)
        else:  # an assignment target
            super().visit_Tuple(node, frame)

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.mbufo_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it)
    renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _BoundedBuffer(list):
    """The output buffer of a macro, call block, filter block or `{% set %}` block."""

    __slots__ = ("_budget",)

    def __init__(self, budget: RenderBudget) -> None:
        super().__init__()
        self._budget = budget

    def append(self, part: str) -> None:
        self._budget.tick()
        self._budget.spend_buffer(len(part))
        super().append(part)

    def extend(self, parts: Iterable[str]) -> None:
        for part in parts:
            self.append(part)


class _TickingIterable:
    """A loop iterable that checks the deadline at every item; keeps len() for `loop`."""

    __slots__ = ("_items", "_budget")

    def __init__(self, items: Iterable[Any], budget: RenderBudget) -> None:
        self._items = items
        self._budget = budget

    def __iter__(self) -> Iterator[Any]:
        tick = self._budget.tick
        for item in self._items:
            tick()
            yield item

    def __len__(self) -> int:
        return len(self._items)  # type: ignore[arg-type]  # TypeError is what LoopContext expects


def _raise_exception(message: Any) -> None:
    current_budget().measure(message, text=True)
    raise TemplateError(f"chat template raised: {str(message)[:500]}")


def _strftime_now(fmt: Any) -> str:
    if not isinstance(fmt, str):
        raise TemplateError("strftime_now() takes a format string")
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' version: no HTML escaping (jinja's own escapes <, >, &, ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    # Filters marked pass_context / pass_eval_context / pass_environment get that first.
    skip = 1 if getattr(func, "jinja_pass_arg", None) is not None else 0
    check = chat_guards.FILTER_CHECKS.get(name)
    is_text = name in chat_guards.TEXT_FILTERS

    @wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        budget.tick()
        head, data = args[:skip], args[skip:]
        if check is not None and data:
            data = check(budget, data, kwargs)
        if is_text:
            for value in (*data, *kwargs.values()):
                budget.measure(value, text=True)
        result = func(*head, *data, **kwargs)
        budget.measure(result)
        return result

    return guarded


def _guard_test(func: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        current_budget().tick()
        return func(*args, **kwargs)

    return guarded


def _finalize(value: Any) -> Any:
    """Every `{{ expression }}` passes here before str(): data only, of bounded size."""
    if not isinstance(value, str):
        current_budget().measure(value, text=True)
    return value


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """One per chat template; renders only through `render`, which sets the budget."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        # The options transformers uses, so that templates render as their authors saw.
        super().__init__(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationTag],
            finalize=_finalize,
        )
        self.globals.pop("lipsum", None)  # unbounded text generator, never used by templates
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.tests = {name: _guard_test(f) for name, f in self.tests.items()}

    # ---- compile and render ---------------------------------------------------------

    def compile_template(self, source: str) -> jinja2.Template:
        if len(source) > MAX_SOURCE_CHARS:
            raise TemplateError(
                f"chat template is {len(source)} chars long, more than {MAX_SOURCE_CHARS}"
            )
        try:
            tree = self.parse(source)
            for kind, tag in _FORBIDDEN_TAGS.items():
                for node in tree.find_all(kind):
                    raise TemplateError(
                        f"chat template may not use {{% {tag} %}} (line {node.lineno})"
                    )
            return self.from_string(tree)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"chat template syntax error at line {e.lineno}: {e.message}"
            ) from None
        except TemplateError:
            raise
        except RecursionError:
            raise TemplateError("chat template is nested too deeply to compile") from None
        except Exception as e:  # e.g. an integer literal too long, Python's block limit
            raise TemplateError(
                f"chat template cannot be compiled: {type(e).__name__}: {str(e)[:300]}"
            ) from e

    def render(self, template: jinja2.Template, context: dict[str, Any], *,
               time_limit_s: float, max_output_chars: int) -> str:
        """Render under a deadline; values and output may exceed the size of the context's
        own data by at most `max_output_chars`."""
        budget = RenderBudget(time_limit_s, max_chars=1 << 62)
        token = activate(budget)
        try:
            input_chars = sum(budget.measure(value) for value in context.values())
            budget.max_chars = max_output_chars + input_chars
            return template.render(context)
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(f"chat template tried an unsafe operation: {e}") from e
        except RecursionError:
            raise TemplateError("chat template recursed too deeply") from None
        except MemoryError:
            raise TemplateError("chat template ran out of memory") from None
        except Exception as e:  # anything a template does wrong is a template error
            raise TemplateError(f"chat template failed: {type(e).__name__}: {str(e)[:300]}") from e
        finally:
            deactivate(token)

    # ---- hooks called by compiled template code ---------------------------------------

    @staticmethod
    def concat(parts: Iterable[str]) -> str:  # type: ignore[override]
        """Joins output and every buffer (macro bodies, `{% set %}` blocks, filter blocks)."""
        budget = current_budget()
        total, out = 0, []
        for part in parts:
            budget.tick()
            total += len(part)
            if total > budget.max_chars:
                raise budget.too_large("output", total)
            out.append(part)
        return "".join(out)

    def mbufo_buffer(self) -> _BoundedBuffer:
        return _BoundedBuffer(current_budget())

    def mbufo_iter(self, items: Iterable[Any]) -> _TickingIterable:
        return _TickingIterable(items, current_budget())

    def mbufo_value(self, value: Any) -> Any:
        current_budget().measure(value)
        return value

    def mbufo_concat(self, parts: tuple[Any, ...]) -> str:
        """The `~` operator."""
        budget = current_budget()
        texts = []
        for part in parts:
            if not isinstance(part, str):
                budget.measure(part, text=True)
                part = str(part)
            texts.append(part)
        budget.check(sum(map(len, texts)), "string")
        return "".join(texts)

    def getattr(self, obj: Any, attribute: str) -> Any:
        current_budget().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        current_budget().tick()
        return super().getitem(obj, argument)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
        budget.tick()
        chat_guards.check_binop(budget, operator, left, right)
        result = self.binop_table[operator](left, right)
        budget.measure(result)
        return result

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            chat_guards.check_str_format(current_budget(), fmt, is_map, args, kwargs)
            return sandboxed(*args, **kwargs)

        return bounded

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = current_budget()
        budget.tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes, int)):
            args = chat_guards.check_method(budget, owner, __obj.__name__, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        budget.measure(result)
        return result
