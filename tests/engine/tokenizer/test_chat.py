"""ChatTemplate: built-in formats, real model templates, the HF render context, input
validation. Expected prompts are written out by hand from each family's published format."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path

import pytest

from engine.errors import TemplateError
from engine.tokenizer.chat import ChatTemplate

TEMPLATES = Path(__file__).parent / "chat_templates"

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{
            "id": "call_0001",
            "type": "function",
            # OpenAI's wire format: arguments as JSON text.
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }],
    },
    {"role": "tool", "tool_call_id": "call_0001", "content": "sunny, 21 C"},
]


TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def real(name: str, **kwargs: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), **kwargs)


# ---- built-in templates ----------------------------------------------------------------

GEMMA_EXPECTED = (
    "<bos><start_of_turn>user\nYou are terse.\n\nHi there<end_of_turn>\n"
    "<start_of_turn>model\nHello.<end_of_turn>\n"
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
)
LLAMA3_EXPECTED = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
)
CHATML_EXPECTED = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi there<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
)


@pytest.mark.parametrize(
    ("arch", "bos", "expected", "prompt"),
    [
        ("gemma3", "<bos>", GEMMA_EXPECTED, "<start_of_turn>model\n"),
        ("llama", "<|begin_of_text|>", LLAMA3_EXPECTED,
         "<|start_header_id|>assistant<|end_header_id|>\n\n"),
        ("qwen2", "<|endoftext|>", CHATML_EXPECTED, "<|im_start|>assistant\n"),
        ("qwen3", "<|endoftext|>", CHATML_EXPECTED, "<|im_start|>assistant\n"),
        ("some-new-family", "<s>", CHATML_EXPECTED, "<|im_start|>assistant\n"),
    ],
)
def test_builtin_renders_published_format(arch, bos, expected, prompt):
    chat = ChatTemplate.for_model(arch, None, bos_token=bos, eos_token="</s>")
    assert chat.is_builtin
    assert chat.render(CONVERSATION, add_generation_prompt=False) == expected
    assert chat.render(CONVERSATION) == expected + prompt


def test_builtin_gemma_matches_gemma3_own_template():
    ours = ChatTemplate.for_model("gemma3", "", bos_token="<bos>", eos_token="<eos>")
    theirs = real("gemma-3", bos_token="<bos>", eos_token="<eos>")
    for conversation in (CONVERSATION, CONVERSATION[1:]):
        for prompt in (True, False):
            expected = theirs.render(conversation, add_generation_prompt=prompt)
            assert ours.render(conversation, add_generation_prompt=prompt) == expected


def test_builtin_gemma_keeps_a_lone_system_message():
    chat = ChatTemplate.for_model("gemma3", None, bos_token="<bos>", eos_token="<eos>")
    out = chat.render([{"role": "system", "content": "Rules."}], add_generation_prompt=False)
    assert out == "<bos><start_of_turn>system\nRules.<end_of_turn>\n"


def test_for_model_prefers_the_gguf_template():
    source = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    chat = ChatTemplate.for_model("gemma3", source, bos_token="<bos>", eos_token="<eos>")
    assert not chat.is_builtin
    assert chat.source == source
    assert chat.sha256 == hashlib.sha256(source.encode()).hexdigest()
    assert chat.render(CONVERSATION[:2]) == "[system]You are terse.[user]Hi there"


def test_syntax_error_names_the_line():
    with pytest.raises(TemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for x in %}")


# ---- real templates --------------------------------------------------------------------


def test_llama31_with_tools():
    chat = real("llama-3.1", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    out = chat.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert out.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n")
    assert "Environment: ipython\n" in out
    assert "Today Date: 26 Jul 2024\n" in out
    # tojson(indent=4) of the tool, as json.dumps writes it.
    assert json.dumps(WEATHER_TOOL, indent=4) in out
    assert "Weather in Paris?<|eot_id|>" in out
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in out
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 C"<|eot_id|>' in out
    assert out.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    dated = chat.render(CONVERSATION, date_string="01 Jan 2025")
    assert "Today Date: 01 Jan 2025\n" in dated and "Environment: ipython" not in dated


def test_qwen25_plain_and_tools():
    chat = real("qwen2.5", eos_token="<|im_end|>")
    assert chat.render(CONVERSATION[1:2]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    out = chat.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in out
    assert TOOL_CALL in out
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n" in out


def test_qwen3_reasoning():
    chat = real("qwen3", eos_token="<|im_end|>")
    history = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"},
    ]
    out = chat.render(history)
    # Thinking of turns before the last user query is dropped.
    assert "<|im_start|>assistant\n4<|im_end|>\n" in out and "add them" not in out
    assert out.endswith("<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n")
    off = chat.render(history, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # After the last user query (a tool loop) the reasoning is kept.
    current = [*history, {"role": "assistant", "content": "6", "reasoning_content": "sum"}]
    kept = chat.render(current, add_generation_prompt=False)
    assert kept.endswith("<|im_start|>assistant\n<think>\nsum\n</think>\n\n6<|im_end|>\n")


def test_qwen3_tools():
    chat = real("qwen3", eos_token="<|im_end|>")
    out = chat.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert out.startswith("<|im_start|>system\n# Tools\n")
    assert TOOL_CALL in out


def test_gemma3_own_template_and_its_role_check():
    chat = real("gemma-3", bos_token="<bos>", eos_token="<eos>")
    assert chat.render(CONVERSATION) == GEMMA_EXPECTED + "<start_of_turn>model\n"
    with pytest.raises(TemplateError, match="roles must alternate"):
        chat.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_mistral_raise_exception_on_bad_role_order():
    chat = real("mistral-7b-v0.2", bos_token="<s>", eos_token="</s>")
    good = chat.render(CONVERSATION[1:])
    assert good == "<s>[INST] Hi there [/INST]Hello.</s>[INST] What is 2+2? [/INST]"
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        chat.render([{"role": "assistant", "content": "first"}])
    with pytest.raises(TemplateError, match="Only user and assistant roles"):
        chat.render([CONVERSATION[1], CONVERSATION[0]])


# ---- the render context ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("{{ {'a': '<é>'}|tojson }}", '{"a": "<é>"}'),  # no HTML escaping, no \u by default
        ("{{ {'a': 'é'}|tojson(ensure_ascii=True) }}", '{"a": "\\u00e9"}'),
        ("{{ [1, {'b': 2}]|tojson(indent=2) }}", json.dumps([1, {"b": 2}], indent=2)),
        ("{{ {'b': 1, 'a': 2}|tojson(sort_keys=True, separators=(',', ':')) }}", '{"a":2,"b":1}'),
        ("{% for i in range(9) %}{% if i == 4 %}{% break %}{% endif %}{% if i is odd %}"
         "{% continue %}{% endif %}{{ i }}{% endfor %}", "02"),
        ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
         "{% endfor %}{{ ns.n }}", "1"),
        ("{% generation %}{{ messages[0].content }}{% endgeneration %}", "hi"),
        ("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools }}",
         "<s>|</s>|True|None"),
        ("{{ messages[0].role ~ '/' ~ messages|length }}", "user/1"),
        ("{{ '%*d|%-3s|%.2f' % (4, 7, 'ab', 3.14159) }}{{ '%d' % 10**9 }}",
         "   7|ab |3.141000000000"),
        ("{{ '%(a)s-%(b)03d' % {'a': 'x', 'b': 7} }}{{ '%s!'|format('q') }}", "x-007q!"),
        ("{{ '{0:>{1}}|{0!r}|{n}'.format('a', 3, n=5) }}", "  a|'a'|5"),
        ("{{ '{a}{b}'.format_map({'a': 1, 'b': 'z'}) }}{{ 'ab'.center(6, '*') }}", "1z**ab**"),
        ("{{ ['a', 'b']|join(', ') }}|{{ '-'.join(['c', 'd']) }}|{{ 'a\tb'.expandtabs(4) }}",
         "a, b|c-d|a   b"),
        ("{{ 'x'|indent(2, first=True) }}|{{ 'aXa'|replace('X', 'yy') }}|{{ 'hello'|truncate(3, "
         "leeway=0) }}", "  x|ayya|..."),
        ("{{ 2 ** 10 }} {{ [0] * 3 }} {{ 'ab' * 2 }} {{ [1] + [2] }}",
         "1024 [0, 0, 0] abab [1, 2]"),
    ],
)
def test_context_and_filters(source, expected):
    chat = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert chat.render([{"role": "user", "content": "hi"}]) == expected


def test_strftime_now():
    chat = ChatTemplate("{{ strftime_now('%Y') }}")
    assert chat.render([{"role": "user", "content": "x"}]) == str(datetime.now().year)


def test_render_takes_well_under_5_ms():
    import time

    chat = real("llama-3.1", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    chat.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        chat.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
        best = min(best, time.perf_counter() - start)
    assert best < 0.005


# ---- message validation ----------------------------------------------------------------

ECHO = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def test_text_parts_are_joined_and_null_content_is_empty():
    chat = ChatTemplate(ECHO)
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    messages = [{"role": "user", "content": parts}, {"role": "assistant", "content": None}]
    assert chat.render(messages) == "<user>one\ntwo<assistant>"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([["user", "hi"]], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\].role must be a non-empty string"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\].role"),
        ([{"role": "user", "content": 42}], r"messages\[0\].content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
         r"content\[0\] must be a text part, got 'image_url'"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"text must be a string"),
        ([{"role": "user", "content": "hi", "name": object()}], "JSON-like"),
        ([{"role": "user", "content": "hi", "meta": {1: "x"}}], "non-string key"),
        ([{"role": "assistant", "content": "", "tool_calls": "x"}], "tool_calls must be a list"),
    ],
)
def test_invalid_messages(messages, match):
    with pytest.raises(TemplateError, match=match):
        ChatTemplate(ECHO).render(messages)


def test_invalid_tools_and_extras():
    chat = ChatTemplate(ECHO)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(TemplateError, match="tools must be a list"):
        chat.render(messages, tools={"type": "function"})
    with pytest.raises(TemplateError, match=r"tools\[0\] must be an object"):
        chat.render(messages, tools=["get_weather"])
    with pytest.raises(TemplateError, match="bos_token"):
        chat.render(messages, bos_token="<evil>")
    with pytest.raises(TemplateError, match="JSON-like"):
        chat.render(messages, enable_thinking=print)
    deep: list = []
    for _ in range(40):
        deep = [deep]
    with pytest.raises(TemplateError, match="nested"):
        chat.render(messages, documents=deep)


def test_messages_are_copied_not_shared():
    chat = ChatTemplate("{{ messages[0].content }}")
    message = {"role": "user", "content": "a"}
    assert chat.render([message]) == "a"
    assert message == {"role": "user", "content": "a"}
