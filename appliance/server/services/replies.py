"""An assistant's reply split into reasoning, content and tool calls.

Models write their reasoning and their tool calls into the text they generate, each
family in its own markup:
- think tags (Qwen3, DeepSeek-R1, QwQ): `<think>reasoning</think>content`. A template
  that opens `<think>` in its generation prompt starts the reply inside the reasoning.
- Hermes tool calls (Qwen 2.5 / 3, Hermes): `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`, one block a call; Qwen3-Coder's XML in the same block,
  `<function=NAME><parameter=KEY>value</parameter></function>`, each value read by the
  type its parameter's schema gives (text for strings, JSON otherwise).
- Llama 3.1 tool calls: the whole reply is `{"name": ..., "parameters": {...}}`, after an
  optional `<|python_tag|>`.
- Mistral tool calls: `[TOOL_CALLS]` and a JSON list of calls (Mistral Nemo), or
  `[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}` a call (Mistral Small 3.2, Devstral);
- OpenAI's harmony (gpt-oss): messages of a header and a body,
  `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`;
  a tool call is a commentary message to `functions.NAME`, its body the arguments.

A parser is fed the reply's text as it streams and returns what is settled. Text that may
still be the start of a marker is held back until the next piece decides it, and so is
whitespace that a marker would drop (the blank lines around `</think>`). Nothing is lost:
markup that does not parse (a tool call whose JSON is broken, a harmony header without
its message) comes out as content, verbatim. A reply fed in any split gives the same
parts as the reply fed whole.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
M_CALLS, M_ARGS, M_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
H_START, H_CHANNEL, H_MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
H_ENDS = ("<|end|>", "<|call|>", "<|return|>", H_START)
MAX_HEADER_CHARS = 1024  # a harmony header longer than this is not a header


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Parts:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add(self, other: Parts) -> Parts:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        return self


class ReplyParser(Protocol):
    """Fed a reply's text in order; `finish` once, after the last piece."""

    def feed(self, text: str) -> Parts: ...
    def finish(self) -> Parts: ...


class PlainReply:
    def feed(self, text: str) -> Parts:
        return Parts(content=text)

    def finish(self) -> Parts:
        return Parts()


def held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that begins one of `markers`."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(at, m) for m in markers if (at := text.find(m)) >= 0]
    return min(found) if found else None


class _Sink:
    """One destination (content or reasoning) that drops the blank space a marker touches:
    the line breaks at the start of a part (not its indentation: a reply may begin with
    code) and the whitespace before the marker that ends it."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.is_fresh = True  # nothing emitted since the last marker
        self.held = ""  # trailing whitespace: emitted once more text follows

    def put(self, text: str, out: Parts) -> None:
        if self.is_fresh:
            text = text.lstrip("\r\n")
        if not text:
            return
        body = text.rstrip()
        if body:
            self._emit(self.held + body, out)
            self.held, self.is_fresh = "", False
        self.held += text[len(body):]

    def close(self, out: Parts, keep_tail: bool = False) -> None:
        if keep_tail and self.held:
            self._emit(self.held, out)
        self.held, self.is_fresh = "", True

    def _emit(self, text: str, out: Parts) -> None:
        if self.kind == "content":
            out.content += text
        else:
            out.reasoning += text


class TaggedReply:
    """Think tags and Hermes tool calls (either may be off)."""

    def __init__(self, *, think: bool, tools: bool, in_reasoning: bool = False,
                 schemas: dict[str, Any] | None = None) -> None:
        """schemas: the offered functions' parameter schemas by name (XML values' types)."""
        self._opens = (((THINK_OPEN,) if think else ()) + ((TOOL_OPEN,) if tools else ()))
        self._schemas = schemas or {}
        self._mode = "reasoning" if in_reasoning else "content"
        self._sinks = {"content": _Sink("content"), "reasoning": _Sink("reasoning")}
        self._buf = ""

    def _markers(self) -> tuple[str, ...]:
        return {"content": self._opens, "reasoning": (THINK_CLOSE,),
                "tool": (TOOL_CLOSE,)}[self._mode]

    def feed(self, text: str) -> Parts:
        out = Parts()
        self._buf += text
        while (hit := first_marker(self._buf, self._markers())) is not None:
            at, marker = hit
            before, self._buf = self._buf[:at], self._buf[at + len(marker):]
            self._end_part(before, out, marker)
        if self._mode != "tool":
            cut = len(self._buf) - held_prefix(self._buf, self._markers())
            self._sinks[self._mode].put(self._buf[:cut], out)
            self._buf = self._buf[cut:]
        return out

    def finish(self) -> Parts:
        out = Parts()
        if self._mode == "tool":
            self._end_call(self._buf, "", out)  # a call cut off before its closing tag
        else:
            self._sinks[self._mode].put(self._buf, out)
        self._buf = ""
        for sink in self._sinks.values():
            sink.close(out, keep_tail=sink.kind == "content")
        return out

    def _end_part(self, text: str, out: Parts, marker: str) -> None:
        if self._mode == "tool":
            self._end_call(text, TOOL_CLOSE, out)
            self._mode = "content"
            return
        sink = self._sinks[self._mode]
        sink.put(text, out)
        if marker != TOOL_OPEN:  # a call's whitespace goes only once the call parses
            sink.close(out)
        self._mode = {THINK_OPEN: "reasoning", TOOL_OPEN: "tool"}.get(marker, "content")

    def _end_call(self, text: str, close: str, out: Parts) -> None:
        sink = self._sinks["content"]
        call = parse_tool_json(text) or parse_xml_call(text, self._schemas)
        if call is not None:
            out.tool_calls.append(call)
            sink.close(out)
        else:  # not a call after all: the text as the model wrote it
            sink.put(TOOL_OPEN + text + close, out)


_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*\Z", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def parse_xml_call(text: str, schemas: dict[str, Any]) -> ToolCall | None:
    """Qwen3-Coder's `<function=NAME><parameter=KEY>\nvalue\n</parameter>...</function>`;
    None unless the text is exactly that."""
    m = _XML_FUNCTION.match(text)
    if m is None or not CALL_NAME.fullmatch(name := m.group(1).strip()):
        return None
    schema = schemas.get(name)
    props = schema.get("properties", {}) if isinstance(schema, dict) else {}
    args: dict[str, Any] = {}
    body, at = m.group(2), 0
    for p in _XML_PARAMETER.finditer(body):
        if body[at:p.start()].strip():
            return None
        args[p.group(1).strip()] = _xml_value(p.group(2), props.get(p.group(1).strip()))
        at = p.end()
    if body[at:].strip():
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _xml_value(raw: str, schema: Any) -> Any:
    """A parameter's text as its schema's type: strings as written, booleans also as
    Python spells them (the template writes `value | string`), the rest as JSON; text that
    does not parse stays text."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        return raw
    if kind == "boolean" and raw.strip() in ("True", "False", "true", "false"):
        return raw.strip().lower() == "true"
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw


def mistral_call_id() -> str:
    """Mistral's templates refuse a call id that is not 9 letters and digits."""
    return uuid.uuid4().hex[:9]


class MistralReply:
    """Content streams until the first `[TOOL_CALLS]`; from it the reply is held and
    parsed at its end (the calls end the reply)."""

    def __init__(self) -> None:
        self._buf = ""
        self._in_calls = False
        self._sink = _Sink("content")

    def feed(self, text: str) -> Parts:
        out = Parts()
        self._buf += text
        if self._in_calls:
            return out
        at = self._buf.find(M_CALLS)
        if at >= 0:
            self._sink.put(self._buf[:at], out)
            self._buf, self._in_calls = self._buf[at:], True
            return out
        cut = len(self._buf) - held_prefix(self._buf, (M_CALLS,))
        self._sink.put(self._buf[:cut], out)
        self._buf = self._buf[cut:]
        return out

    def finish(self) -> Parts:
        out = Parts()
        calls = parse_mistral_calls(self._buf) if self._in_calls else None
        if calls:
            out.tool_calls += calls
            self._sink.close(out)
        else:  # no calls, or calls that do not parse: the text as written
            self._sink.put(self._buf, out)
            self._sink.close(out, keep_tail=True)
        self._buf = ""
        return out


def parse_mistral_calls(text: str) -> list[ToolCall] | None:
    """The calls of `[TOOL_CALLS]...` in either Mistral form; None if any does not parse."""
    parts = text.split(M_CALLS)[1:]
    if len(parts) == 1 and parts[0].lstrip().startswith("["):  # Nemo: a JSON list
        try:
            items = json.loads(parts[0])
        except (ValueError, RecursionError):
            return None
        if not isinstance(items, list) or not items:
            return None
        calls = [parse_tool_json(json.dumps(item)) if isinstance(item, dict) else None
                 for item in items]
        if any(c is None for c in calls):
            return None
        for call, item in zip(calls, items, strict=True):
            assert call is not None
            given = item.get("id")
            call.id = given if isinstance(given, str) and given.isalnum() else mistral_call_id()
        return [c for c in calls if c is not None]
    out = []
    for part in parts:
        head, sep, args = part.partition(M_ARGS)
        name, _, call_id = head.partition(M_CALL_ID)
        name, args, call_id = name.strip(), args.strip(), call_id.strip()
        if not sep or not CALL_NAME.fullmatch(name) or not is_json(args):
            return None
        out.append(ToolCall(name, args, call_id if call_id.isalnum() else mistral_call_id()))
    return out or None


class JsonToolReply:
    """Llama 3.1's tool calls: a reply that is one JSON object with a name and parameters.
    A reply that starts like one is held until it ends; any other streams as content."""

    def __init__(self) -> None:
        self._buf = ""
        self._is_plain = False

    def feed(self, text: str) -> Parts:
        if self._is_plain:
            return Parts(content=text)
        self._buf += text
        head = self._buf.lstrip()
        if head.startswith(("{", PYTHON_TAG)) or (head and PYTHON_TAG.startswith(head)):
            return Parts()
        if not head:
            return Parts()
        self._is_plain = True
        text, self._buf = self._buf, ""
        return Parts(content=text)

    def finish(self) -> Parts:
        text, self._buf = self._buf, ""
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):]
        calls = [parse_tool_json(part) for part in _split_calls(body)] if body else []
        if calls and all(c is not None for c in calls):
            return Parts(tool_calls=[c for c in calls if c is not None])
        return Parts(content=text)


def _split_calls(body: str) -> list[str]:
    """Llama 3.x writes parallel calls as JSON objects separated by `;` (or newlines)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return [body]
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return parts


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


def parse_tool_json(text: str) -> ToolCall | None:
    """`{"name": ..., "arguments" | "parameters": {...}}` -> a call; None if it is not one."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ToolCall(obj["name"], args) if is_json(args) else None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


CALL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's function names (and dots)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(re.escape(H_CHANNEL) + r"\s*(\w+)")


class HarmonyReply:
    """gpt-oss's harmony messages: analysis -> reasoning, final and commentary -> content,
    a message to `functions.NAME` -> a tool call. The reply starts with a header (the
    prompt ends with `<|start|>assistant`)."""

    def __init__(self) -> None:
        self._buf = ""
        self._route: str | None = None  # None: reading a header; else where the body goes
        self._tool_name = ""
        self._header = ""  # a call's header as written: content again if the call is not one
        self._sinks = {"content": _Sink("content"), "reasoning": _Sink("reasoning")}

    def feed(self, text: str) -> Parts:
        out = Parts()
        self._buf += text
        while True:
            if self._route is None:
                at = self._buf.find(H_MESSAGE)
                if at < 0:
                    if len(self._buf) > MAX_HEADER_CHARS:  # not harmony: keep it as text
                        self._route = "content"
                        continue
                    break
                self._header = self._buf[:at + len(H_MESSAGE)]
                self._route, self._tool_name = route_header(self._header)
                self._buf = self._buf[at + len(H_MESSAGE):]
                continue
            hit = first_marker(self._buf, H_ENDS)
            if hit is None:
                break
            at, marker = hit
            body = self._buf[:at]
            self._buf = self._buf[at + (0 if marker == H_START else len(marker)):]
            self._end_body(body, out)
        if self._route in ("content", "reasoning"):
            keep = held_prefix(self._buf, H_ENDS)
            cut = len(self._buf) - keep
            self._sinks[self._route].put(self._buf[:cut], out)
            self._buf = self._buf[cut:]
        return out

    def finish(self) -> Parts:
        out = Parts()
        if self._route is None:
            rest = self._buf.strip()
            if rest and rest not in (H_START + "assistant", H_START):
                self._sinks["content"].put(self._buf, out)  # not a header after all
        else:
            self._end_body(self._buf, out, keep_tail=True)
        self._buf = ""
        for sink in self._sinks.values():
            sink.close(out, keep_tail=sink.kind == "content")
        return out

    def _end_body(self, body: str, out: Parts, keep_tail: bool = False) -> None:
        if self._route == "tool":
            args = body.strip() or "{}"
            if is_json(args):
                out.tool_calls.append(ToolCall(self._tool_name, args))
            else:  # cut short, or not JSON: the message as written
                sink = self._sinks["content"]
                sink.put(self._header + body, out)
                sink.close(out, keep_tail=keep_tail)
        elif self._route is not None:
            sink = self._sinks[self._route]
            sink.put(body, out)
            sink.close(out, keep_tail=keep_tail and sink.kind == "content")
        self._route, self._tool_name = None, ""


def route_header(header: str) -> tuple[str, str]:
    """(route, tool name) of a harmony header such as `<|start|>assistant<|channel|>
    commentary to=functions.get_weather <|constrain|>json`."""
    recipient = m.group(1) if (m := _RECIPIENT.search(header)) else ""
    if recipient.startswith("functions.") and len(recipient) > len("functions."):
        return "tool", recipient[len("functions."):]
    channel = m.group(1) if (m := _CHANNEL.search(header)) else ""
    return ("reasoning" if channel == "analysis" else "content"), ""


def thinking_mode(template: str, prompt: str) -> str:
    """Whether a reply may begin with reasoning that a grammar must let through
    (engine/grammar.py's THINK_MODES): "open" where the prompt ends inside `<think>`,
    "none" where it closed the block (Qwen3 without thinking) or the template has no think
    tags, else "optional"."""
    if not (THINK_OPEN in template and THINK_CLOSE in template):
        return "none"
    tail = prompt.rstrip()
    if tail.endswith(THINK_OPEN):
        return "open"
    return "none" if tail.endswith(THINK_CLOSE) else "optional"


def tool_markup(template: str) -> str | None:
    """How a model with this chat template source writes tool calls: "harmony",
    "mistral_args" (`[TOOL_CALLS]NAME[ARGS]{...}`), "mistral_json" (`[TOOL_CALLS][{...}]`),
    "qwen3_xml" (`<tool_call><function=NAME>` blocks), "hermes" (`<tool_call>` JSON
    blocks), "llama_json" (a JSON object with "parameters"), or None."""
    if H_CHANNEL in template and H_MESSAGE in template:
        return "harmony"
    if M_CALLS in template:
        return "mistral_args" if M_ARGS in template else "mistral_json"
    if TOOL_OPEN in template and "<function=" in template:
        return "qwen3_xml"
    if TOOL_OPEN in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama_json"
    return None


def reply_parser_factory(template: str, prompt: str, *, tools: list[dict[str, Any]] | None,
                         parse: bool = True) -> Callable[[], ReplyParser]:
    """What splits a reply of a model with this chat template source, after this rendered
    prompt. tools: those the request offers (None or empty: no calls are parsed)."""
    if not parse:
        return PlainReply
    markup = tool_markup(template)
    if markup == "harmony":
        return HarmonyReply
    think = THINK_OPEN in template and THINK_CLOSE in template
    hermes = bool(tools) and markup in ("hermes", "qwen3_xml")
    if think or hermes:
        in_reasoning = thinking_mode(template, prompt) == "open"
        schemas = {f["name"]: f.get("parameters") for t in tools or ()
                   if isinstance(t, dict) and isinstance(f := t.get("function"), dict)
                   and isinstance(f.get("name"), str)}
        return lambda: TaggedReply(think=think, tools=hermes, in_reasoning=in_reasoning,
                                   schemas=schemas)
    if tools and markup == "llama_json":
        return JsonToolReply
    if tools and markup in ("mistral_args", "mistral_json"):
        return MistralReply
    return PlainReply
