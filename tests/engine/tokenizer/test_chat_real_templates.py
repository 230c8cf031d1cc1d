"""Parity of chat rendering with independent implementations.

- Every real template llama.cpp ships for its tests (`models/templates/*.jinja`, from the
  reference sdist) renders exactly as stock jinja renders it when configured the way
  transformers configures it: the limits and checks of our sandbox must never change the
  output of a legitimate template, nor make one fail that works there.
- The built-in Gemma, Llama 3 and ChatML templates produce what llama.cpp's own built-in
  formats (`llama_chat_apply_template`) produce.
"""

from __future__ import annotations

import ctypes
import json
from datetime import datetime
from pathlib import Path

import pytest
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import TemplateError
from engine.tokenizer.chat import ChatTemplate

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]
CONVERSATIONS = {
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "plain": [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "tools": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call12345", "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }]},
        {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "sunny"},
    ],
}


class _Generation(Extension):
    """transformers' `{% generation %}` tag, which renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Raised(Exception):
    pass


def _reference_env() -> ImmutableSandboxedEnvironment:
    """transformers' chat-template environment (`_compile_jinja_template`)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def raise_exception(message):
        raise _Raised(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _openai_wire(messages: list[dict]) -> list[dict]:
    """The same conversation as a client sends it: tool-call arguments as JSON text."""
    out = json.loads(json.dumps(messages))
    for message in out:
        for call in message.get("tool_calls", ()):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


def _compare(env: ImmutableSandboxedEnvironment, path: Path) -> tuple[list, int]:
    """(mismatches, number of conversations the reference renders) for one template."""
    source = path.read_text()
    ours = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    reference = env.from_string(source)
    mismatches, rendered = [], 0
    for name, messages in CONVERSATIONS.items():
        tools = TOOLS if name == "tools" else None
        try:
            expected = reference.render(messages=messages, tools=tools, add_generation_prompt=True,
                                        bos_token="<s>", eos_token="</s>")
        except Exception:
            expected = None
        try:
            got = ours.render(_openai_wire(messages), tools=tools)
        except TemplateError:
            got = None
        rendered += expected is not None
        if got != expected:
            mismatches.append((path.name, name, (got or "")[:200], (expected or "")[:200]))
    return mismatches, rendered


# Major families, cheap to compile; the slow test below covers every template.
CORE = [
    "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
    "Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "Qwen-QwQ-32B",
    "mistralai-Mistral-Nemo-Instruct-2407", "google-gemma-2-2b-it",
    "microsoft-Phi-3.5-mini-instruct", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "HuggingFaceTB-SmolLM3-3B",
    "ibm-granite-granite-3.3-2B-Instruct", "meetkai-functionary-medium-v3.1",
]


@pytest.mark.parametrize("name", CORE)
def test_real_template_renders_as_stock_jinja(llama_vendor: Path, name: str):
    path = llama_vendor / "models" / "templates" / f"{name}.jinja"
    mismatches, rendered = _compare(_reference_env(), path)
    assert not mismatches
    assert rendered >= 1


@pytest.mark.slow
def test_every_real_template_renders_as_stock_jinja(llama_vendor: Path):
    paths = sorted((llama_vendor / "models" / "templates").glob("*.jinja"))
    assert len(paths) >= 50
    env = _reference_env()
    mismatches, rendered = [], 0
    for path in paths:
        bad, good = _compare(env, path)
        mismatches += bad
        rendered += good
    assert not mismatches
    assert rendered >= 150  # most pairs render; a few templates refuse a conversation


# ---- built-in templates against llama.cpp's built-in formats ----------------------------


def _llama_cpp_format(name: str, messages: list[dict], add_generation_prompt: bool) -> str:
    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(*[
        llama_cpp.llama_chat_message(m["role"].encode(), m["content"].encode())
        for m in messages
    ])
    size = 4096
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages),
                                            add_generation_prompt, buf, size)
    assert 0 < n < size
    return buf.raw[:n].decode()


@pytest.mark.parametrize(("arch", "llama_cpp_name"),
                         [("gemma3", "gemma"), ("llama", "llama3"), ("qwen3", "chatml")])
@pytest.mark.parametrize("conversation", ["system", "plain"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_builtin_matches_llama_cpp(arch, llama_cpp_name, conversation, add_generation_prompt):
    # llama.cpp's formats leave BOS to the tokenizer; ours write `bos_token`, empty here.
    chat = ChatTemplate.for_model(arch, None, bos_token="", eos_token="")
    messages = CONVERSATIONS[conversation]
    expected = _llama_cpp_format(llama_cpp_name, messages, add_generation_prompt)
    assert chat.render(messages, add_generation_prompt=add_generation_prompt) == expected
