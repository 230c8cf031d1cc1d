"""Chat templates: a conversation (OpenAI-style messages) rendered to prompt text.

Templates come from the GGUF key `tokenizer.chat_template`, never from a request, and
families without one get a built-in template (`builtin_templates`). A template is
untrusted code: it runs in jinja2's immutable sandbox with a time limit and a size limit
(`chat_sandbox` explains how both are enforced from inside the render). The render
context is the one transformers gives templates: `messages`, `tools`,
`add_generation_prompt`, `bos_token`, `eos_token`, the globals `raise_exception` and
`strftime_now`, the `tojson` filter with `indent` / `ensure_ascii` / `separators` /
`sort_keys`, loop controls and `namespace`, plus whatever keyword arguments the caller
adds (`enable_thinking`, `date_string` ...).

Messages are data and only data: each is validated and copied into plain dicts, lists and
strings before the template sees it, so message content can never act as template code.
`content` may be a string, null (rendered as "") or a list of `{"type": "text"}` parts,
joined with newlines (what vLLM does) so that every template sees a string. Tool-call
arguments given as a JSON string (the OpenAI wire format) are parsed into an object,
which is what templates serialize with `tojson`.

The size limit, `max_output_chars`, bounds what a template adds on top of the request's
own text: a render may produce at most `max_output_chars` plus the size of its input, so
that a long conversation is never refused while a template cannot amplify.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import TemplateError
from engine.tokenizer.builtin_templates import builtin_template
from engine.tokenizer.chat_sandbox import BoundedSandbox

logger = logging.getLogger(__name__)

_MAX_NESTING = 32  # of lists and objects inside a message, a tool or an extra value
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


class ChatTemplate:
    """A compiled chat template bound to a model's BOS and EOS token strings."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 time_limit_s: float = 1.0, max_output_chars: int = 1 << 20) -> None:
        if not isinstance(source, str):
            raise TemplateError(f"chat template must be a string, got {type(source).__name__}")
        if not (isinstance(bos_token, str) and isinstance(eos_token, str)):
            raise TemplateError("bos_token and eos_token must be strings")
        if not time_limit_s > 0 or max_output_chars <= 0:
            raise TemplateError("chat template limits must be positive")
        self.source = source
        self.sha256 = hashlib.sha256(source.encode("utf-8", "surrogatepass")).hexdigest()
        self.is_builtin = False
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.time_limit_s = float(time_limit_s)
        self.max_output_chars = int(max_output_chars)
        self._env = BoundedSandbox()
        self._template = self._env.compile_template(source)

    @classmethod
    def for_model(cls, architecture: str, template: str | None, *, bos_token: str,
                  eos_token: str) -> ChatTemplate:
        """The GGUF's own template when present, else the family's built-in, else ChatML."""
        if template is not None and not isinstance(template, str):
            raise TemplateError(f"chat template must be a string, got {type(template).__name__}")
        if template and template.strip():
            return cls(template, bos_token=bos_token, eos_token=eos_token)
        logger.info("GGUF has no chat template; using the built-in one for %r", architecture)
        chat = cls(builtin_template(architecture), bos_token=bos_token, eos_token=eos_token)
        chat.is_builtin = True
        return chat

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, **extra: Any) -> str:
        """The prompt text; TemplateError names what is wrong with the input or template."""
        context: dict[str, Any] = {}
        for name, value in extra.items():
            if name in _RESERVED:
                raise TemplateError(f"{name!r} cannot be passed as an extra template variable")
            context[name] = _plain(value, name, 0)
        context.update(
            messages=_messages(messages),
            tools=None if tools is None else _tools(tools),
            add_generation_prompt=bool(add_generation_prompt),
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        return self._env.render(self._template, context, time_limit_s=self.time_limit_s,
                                max_output_chars=self.max_output_chars)

    def __repr__(self) -> str:
        kind = "builtin" if self.is_builtin else "gguf"
        return f"ChatTemplate({kind}, sha256={self.sha256[:12]})"


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _plain(value: Any, where: str, depth: int) -> Any:
    """A copy of JSON-like data as plain dicts, lists and scalars."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if depth >= _MAX_NESTING:
        raise TemplateError(f"{where} is nested more than {_MAX_NESTING} levels deep")
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TemplateError(f"{where} has a non-string key {key!r}")
            out[key] = _plain(item, f"{where}.{key}", depth + 1)
        return out
    if _is_list(value):
        return [_plain(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    raise TemplateError(
        f"{where} must be JSON-like data (string, number, bool, null, list, object), "
        f"got {type(value).__name__}"
    )


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not _is_list(messages) or len(messages) == 0:
        raise TemplateError("messages must be a non-empty list of message objects")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


def _message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TemplateError(f"{where} must be an object, got {type(message).__name__}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise TemplateError(f"{where}.role must be a non-empty string")
    out = _plain(message, where, 0)
    out["content"] = _content(message.get("content"), f"{where}.content")
    calls = out.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        raise TemplateError(f"{where}.tool_calls must be a list")
    for call in calls or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            parsed = _parse_arguments(function["arguments"])
            function["arguments"] = _plain(parsed, f"{where}.tool_calls.arguments", 2)
    return out


def _content(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not _is_list(content):
        raise TemplateError(
            f"{where} must be a string or a list of text parts, got {type(content).__name__}"
        )
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TemplateError(f"{where}[{i}] must be a text part, got {kind!r}")
        text = part.get("text")
        if not isinstance(text, str):
            raise TemplateError(f"{where}[{i}].text must be a string")
        texts.append(text)
    return "\n".join(texts)


def _parse_arguments(arguments: str) -> Any:
    """OpenAI sends tool-call arguments as JSON text; templates expect the object."""
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments  # not JSON: leave the text for the template to show as is
    return parsed if isinstance(parsed, dict) else arguments


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not _is_list(tools):
        raise TemplateError("tools must be a list of objects")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise TemplateError(f"tools[{i}] must be an object, got {type(tool).__name__}")
        out.append(_plain(tool, f"tools[{i}]", 0))
    return out
