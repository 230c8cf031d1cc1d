"""Hostile chat templates (the threat: a malicious GGUF) and hostile message content.

A payload used as the template source must either raise TemplateError or render text that
holds no Python object, no file content and has no side effect, within the time limit.
The same payload used as message content must come out literally.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from engine.errors import TemplateError
from engine.tokenizer.chat import ChatTemplate

LIMIT_S = 0.25
SECRET = "canary-5f0c1e9d-secret"
LEAK_MARKERS = ("<class", "<module", "<function", "<built-in", "<bound", "subprocess",
                " at 0x", "__builtins__", "Popen", SECRET)
USER = [{"role": "user", "content": "hi"}]
TEMPLATES = Path(__file__).parent / "chat_templates"

PAYLOADS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('touch CREATED').read() }}",
    "{{ cycler.__init__.__globals__.os.popen('cat CANARY').read() }}",
    "{{ lipsum.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('touch CREATED').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__.__builtins__.open('CANARY').read() }}",
    "{{ self.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ config }}{{ config.items() }}",
    "{{ request }}{{ request.application.__globals__.__builtins__ }}",
    "{{ get_flashed_messages.__globals__ }}{{ url_for.__globals__ }}",
    "{{ ''|attr('__class__') }}",
    "{{ ''|attr('__class__')|attr('__mro__') }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ '{0.__init__.__globals__}'.format(cycler) }}",
    "{% set x = messages.append(1) %}{{ messages|length }}",
    "{% set x = messages[0].update({'role': 'system'}) %}{{ messages[0].role }}",
    "{{ [].__class__.__base__.__subclasses__() }}",
    "{{ ().__class__.__bases__[0] }}",
    "{{ range.__self__ }}{{ range.__globals__ }}",
    "{{ dict.__base__.__subclasses__() }}",
    "{{ {}.__class__.__subclasses__() }}",
    "{{ dict.mro() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% for c in ''.__class__.__mro__[1].__subclasses__() %}{% if c.__name__ == 'Popen' %}"
    "{{ c('touch CREATED', shell=True) }}{% endif %}{% endfor %}",
    "{{ messages|map(attribute='__class__')|list }}",
    "{{ messages|selectattr('__class__')|list }}",
    "{{ (messages|map('string')).gi_frame.f_globals }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['__builtins__'] }}",
    "{% macro m() %}{{ caller.__globals__ }}{% endmacro %}{% call m() %}x{% endcall %}",
    "{{ undefined_name.__init__ }}",
    # Object reprs give away classes and addresses.
    "{{ namespace }}", "{{ cycler }}", "{{ self }}", "{{ range }}", "{{ messages[0].items }}",
    "{{ [namespace, range] }}", "{{ namespace|string }}", "{{ 'x' ~ joiner }}",
    "{{ '%s'|format(cycler) }}", "{{ '{}'.format(range) }}", "{{ '%s' % namespace }}",
    "{{ raise_exception(cycler) }}",
    # No loader: nothing outside the template can be read.
    "{% include 'CANARY' %}",
    "{% import 'os' as os %}{{ os.popen('touch CREATED') }}",
    "{% from 'os' import popen %}",
    "{% extends 'CANARY' %}",
    # Resource exhaustion.
    "{{ 'a' * 10**9 }}",
    "{{ [1] * 10**9 }}",
    "{{ 10 ** (10 ** 10) }}",
    "{{ (10 ** 5000) * (10 ** 5000) }}",
    "{% for i in range(10**9) %}x{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{{ lipsum(n=10**6) }}",
]


@pytest.fixture
def canary(tmp_path: Path) -> tuple[Path, Path]:
    secret = tmp_path / "canary.txt"
    secret.write_text(SECRET)
    return secret, tmp_path / "created-by-template"


def _attempt(source: str, messages: list) -> tuple[str, float]:
    start = time.perf_counter()
    try:
        text = ChatTemplate(source, time_limit_s=LIMIT_S).render(messages)
    except TemplateError as error:
        text = f"TemplateError: {error}"
    return text, time.perf_counter() - start


@pytest.mark.parametrize("payload", PAYLOADS)
def test_payload_as_template_source(payload, canary):
    secret, created = canary
    source = payload.replace("CANARY", str(secret)).replace("CREATED", str(created))
    text, elapsed = _attempt(source, USER)
    assert elapsed < 2 * LIMIT_S
    for marker in LEAK_MARKERS:
        assert marker not in text, (marker, text[:300])
    assert not created.exists()
    assert "os" not in text.split() and "<module 'os'" not in text


@pytest.fixture(scope="module")
def chatml() -> ChatTemplate:
    return ChatTemplate.for_model("qwen2", None, bos_token="", eos_token="")


@pytest.fixture(scope="module")
def llama() -> ChatTemplate:
    return ChatTemplate((TEMPLATES / "llama-3.1.jinja").read_text(), bos_token="<bos>")


@pytest.mark.parametrize("payload", PAYLOADS + ["{% raw %}", "{#", "}}", "{% endfor %}"])
def test_payload_as_message_content_is_data(payload, chatml, llama):
    messages = [{"role": "user", "content": payload}]
    expected = f"<|im_start|>user\n{payload}<|im_end|>\n<|im_start|>assistant\n"
    assert chatml.render(messages) == expected
    tools = [{"type": "function", "function": {"name": "f", "description": payload}}]
    out = llama.render(messages, tools=tools)
    # Llama 3.1 inlines the first user message after the tool list.
    assert f"\n\n{payload}<|eot_id|><|start_header_id|>assistant" in out
    assert json.dumps(payload)[1:-1] in out  # the tool description, JSON-escaped


# ---- time limit ------------------------------------------------------------------------

RUNAWAY = {
    "nested_ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}",
    "nested_list_loops": "{% set r = range(100000)|list %}{% for i in r %}{% for j in r %}"
                         "{% endfor %}{% endfor %}",
    "macro_fan_out": "{% macro f(n) %}{% if n < 40 %}{{ f(n + 1) }}{{ f(n + 1) }}{% endif %}"
                     "{% endmacro %}{{ f(0) }}",
    "recursive_loop": "{% for x in range(50) recursive %}{{ loop(range(50)) }}{% endfor %}",
    "filter_chain": "{% for i in range(100000) %}{% for j in range(100000) %}"
                    "{{ j|string|lower|length|string|trim }}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", RUNAWAY)
def test_time_limit_stops_runaway_template(name):
    chat = ChatTemplate(RUNAWAY[name], time_limit_s=LIMIT_S)
    start = time.perf_counter()
    with pytest.raises(TemplateError, match=r"time limit|size limit|recursed"):
        chat.render(USER)
    assert time.perf_counter() - start < 2 * LIMIT_S


def test_deep_recursion_is_a_template_error():
    chat = ChatTemplate("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")
    with pytest.raises(TemplateError, match="recursed too deeply"):
        chat.render(USER)


def test_runaway_render_does_not_affect_other_threads():
    runaway = ChatTemplate(RUNAWAY["nested_ranges"], time_limit_s=LIMIT_S)
    errors: list[Exception] = []

    def run() -> None:
        try:
            runaway.render(USER)
        except TemplateError as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    normal = ChatTemplate.for_model("llama", None, bos_token="<s>", eos_token="</s>")
    for _ in range(20):
        assert normal.render(USER).startswith("<s><|start_header_id|>user")
    thread.join()
    assert len(errors) == 1 and "time limit" in str(errors[0])
    assert normal.render(USER).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


# ---- size limit ------------------------------------------------------------------------

AMPLIFIERS = [
    "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}",
    "{% macro m() %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endmacro %}"
    "{{ m()|length }}",
    "{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}",
    "{% filter upper %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endfilter %}",
    "{% set s = 'a' * 500000 %}{% set x %}{% for i in range(100000) %}{{ s ~ i }}{% endfor %}"
    "{% endset %}",
    "{% set s = 'a' * 500000 %}{% macro m() %}{{ s ~ caller() }}{% endmacro %}"
    "{% for i in range(100000) %}{% call m() %}{{ i }}{% endcall %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s * 2 %}"
    "{% endfor %}",
    "{% set ns = namespace(x=[1]) %}{% for i in range(60) %}{% set ns.x = [ns.x, ns.x] %}"
    "{% endfor %}{{ ns.x }}",
    "{% set ns = namespace(x={}) %}{% for i in range(60) %}{% set ns.x = {'a': ns.x, "
    "'b': ns.x} %}{% endfor %}{{ ns.x == ns.x }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '%*d' % (999999999, 1) }}",
    "{{ '%.999999999f' % 1.0 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '{:>{w}}'.format(1, w=999999999) }}",
    "{{ ('{0}' * 100000).format('a' * 1000000) }}",
    "{{ ('{a}' * 100000).format_map({'a': 'a' * 1000000}) }}",
    "{{ ('%(a)s' * 100000) % {'a': 'a' * 1000000} }}",
    "{{ ('%(a)s' * 100000)|format(a='a' * 1000000) }}",
    "{{ 'a'|center(999999999) }}",
    "{{ 'a'.ljust(999999999) }}",
    "{{ 'a'.zfill(10**9) }}",
    "{{ (1).to_bytes(10**9, 'big') }}",
    "{{ ('a' * 10000)|replace('', 'b' * 10000) }}",
    "{{ ('a' * 10000).replace('a', 'b' * 10000) }}",
    "{{ ('a\\n' * 100000)|indent(100) }}",
    "{{ (['a'] * 100000)|join('y' * 100000) }}",
    "{{ ('y' * 100000).join(['a'] * 100000) }}",
    "{{ ('\\t' * 10000).expandtabs(100000) }}",
    "{% set b = ['x'] * 1000 %}{{ ([[b] * 10] * 10)|tojson(indent=1000) }}",
    "{{ [1]|batch(10**9, 'x')|list }}",
    "{{ [1]|slice(10**9)|list }}",
    "{{ ('a ' * 10000)|wordwrap(1, wrapstring='x' * 1000) }}",
    "{{ ('a ' * 100000)|urlize }}{{ ('a ' * 100000)|wordwrap(5) }}",
    "{{ ([[1] * 1000] * 1000)|sum(start=[]) }}",
]


@pytest.mark.parametrize("source", AMPLIFIERS)
def test_size_limit_stops_amplification(source):
    chat = ChatTemplate(source, time_limit_s=5.0)
    start = time.perf_counter()
    with pytest.raises(TemplateError, match="size limit|too large|takes at most"):
        chat.render(USER)
    assert time.perf_counter() - start < 1.0


def test_max_output_chars():
    source = "{% for i in range(3000) %}x{% endfor %}"
    with pytest.raises(TemplateError, match="output exceeds the size limit"):
        ChatTemplate(source, max_output_chars=1000).render(USER)
    assert ChatTemplate(source, max_output_chars=5000).render(USER) == "x" * 3000


def test_long_input_is_not_refused_but_amplifying_it_is():
    long_text = "word " * 20_000  # 100,000 chars
    messages = [{"role": "user", "content": long_text}]
    chatml = ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}", max_output_chars=1000,
    )
    assert chatml.render(messages) == f"<|im_start|>user\n{long_text}<|im_end|>\n"
    thrice = ChatTemplate("{% for i in range(3) %}{{ messages[0].content }}{% endfor %}",
                          max_output_chars=1000)
    with pytest.raises(TemplateError, match="size limit"):
        thrice.render(messages)


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ " + "9" * 5000 + " }}", "cannot be compiled"),
        ("{% for a in b %}" * 25 + "{% endfor %}" * 25, "cannot be compiled"),
        ("{{ " + "(" * 300 + "1" + ")" * 300 + " }}", "nested too deeply"),
        ("x" * 300_000, "more than"),
    ],
)
def test_hostile_source_fails_to_compile_cleanly(source, match):
    with pytest.raises(TemplateError, match=match):
        ChatTemplate(source)


def test_render_works_after_a_failed_render():
    chat = ChatTemplate("{% if messages|length > 1 %}{{ 'a' * 10**9 }}{% endif %}ok")
    with pytest.raises(TemplateError):
        chat.render(USER * 2)
    assert chat.render(USER) == "ok"
