"""Reasoning and tool calls through /v1/chat/completions and the official `openai` client.

The model's engine is replaced by one that writes a scripted reply in small pieces (a
random-weight model writes no markup), under the chat template of the family whose
markup the reply uses; the server, its request checks, the streams and the formats are
the real ones. Streamed deltas must add up to the whole answer's message.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from server_harness import assert_openai_error, start_harness

from engine.scheduler.request import OutputChunk
from engine.tokenizer.chat import ChatTemplate

pytestmark = pytest.mark.anyio
TEMPLATES = Path(__file__).parents[2] / "engine" / "tokenizer" / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",  # gpt-oss's needs one
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
QWEN_REPLY = ('<think>\nThey want the weather.\n</think>\n\nChecking.\n<tool_call>\n'
              '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
HARMONY_REPLY = ("<|channel|>analysis<|message|>Need the tool.<|end|><|start|>assistant"
                 '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                 '{"city":"Paris"}')


class ScriptedEngine:
    """The real engine, but `submit` writes `reply` three characters a chunk."""

    def __init__(self, real, template: str, reply: str) -> None:
        self._real = real
        self.reply = reply
        self.prompts: list[tuple[int, ...]] = []
        self.loaded = SimpleNamespace(
            tokenizer=real.loaded.tokenizer, config=real.loaded.config,
            chat_template=ChatTemplate(template, bos_token="<s>", eos_token="</s>"))

    def __getattr__(self, name):
        return getattr(self._real, name)

    async def submit(self, request):
        self.prompts.append(request.prompt_ids)
        pieces = [self.reply[i:i + 3] for i in range(0, len(self.reply), 3)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield OutputChunk(request.id, (1,), piece, None, "stop" if last else None,
                              len(request.prompt_ids), 0, i + 1)


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, tiny_gguf):
    h = await start_harness(tmp_path_factory.mktemp("replies"), [str(tiny_gguf)], dtype="f32",
                            context=1024)
    yield h
    await h.close()


@pytest.fixture
def scripted(harness, monkeypatch):
    handle = harness.state.router.get(None)

    def use(template: str, reply: str) -> ScriptedEngine:
        engine = ScriptedEngine(handle.engine, template, reply)
        monkeypatch.setattr(handle, "engine", engine)
        return engine
    return use


async def streamed(client, **kwargs):
    stream = await client.chat.completions.create(**kwargs, stream=True)
    content, reasoning, calls, finish = "", "", {}, None
    async for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            for call in c.delta.tool_calls or ():
                calls[call.index] = (call.id, call.function.name, call.function.arguments)
            finish = c.finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("family", ["qwen3", "gpt-oss"])
async def test_reasoning_and_tool_calls_streamed_and_whole(harness, scripted, llama_vendor,
                                                           family):
    if family == "qwen3":
        template, reply = (TEMPLATES / "qwen3.jinja").read_text(), QWEN_REPLY
        content = "Checking."
    else:
        template = (llama_vendor / "models" / "templates" / "openai-gpt-oss-120b.jinja"
                    ).read_text()
        reply, content = HARMONY_REPLY, None
    engine = scripted(template, reply)
    client = harness.openai()
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=32)
    whole = (await client.chat.completions.create(**kwargs)).choices[0]
    message = whole.message
    assert whole.finish_reason == "tool_calls"
    assert message.content == content
    assert message.reasoning_content == ("They want the weather." if family == "qwen3"
                                         else "Need the tool.")
    [call] = message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    # the tools reached the prompt
    prompt = harness.state.router.get(None).tokenizer.decode(list(engine.prompts[-1]))
    assert "get_weather" in prompt

    s_content, s_reasoning, s_calls, s_finish = await streamed(client, **kwargs)
    assert (s_content or None, s_reasoning, s_finish) == (
        message.content, message.reasoning_content, "tool_calls")
    assert [(n, json.loads(a)) for _, n, a in s_calls] == [("get_weather", {"city": "Paris"})]

    # the reply sent back (the next turn of a tool loop) renders and runs
    history = [*ASK, message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    engine.reply = "<think>\nok\n</think>\n\nSunny." if family == "qwen3" else (
        "<|channel|>final<|message|>Sunny.")
    again = (await client.chat.completions.create(**{**kwargs, "messages": history})).choices[0]
    assert (again.message.content, again.finish_reason) == ("Sunny.", "stop")


async def test_reasoning_effort_reaches_the_template(harness, scripted, llama_vendor):
    template = (llama_vendor / "models" / "templates" / "openai-gpt-oss-120b.jinja").read_text()
    engine = scripted(template, "<|channel|>final<|message|>ok")
    client = harness.openai()
    tok = harness.state.router.get(None).tokenizer
    for effort, kwargs, want in ((None, {}, "Reasoning: medium"),
                                 ("low", {}, "Reasoning: low"),
                                 ("high", {"reasoning_effort": "low"}, "Reasoning: low")):
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        if effort:
            extra["reasoning_effort"] = effort
        resp = await client.chat.completions.create(model="tiny", messages=ASK, max_tokens=8,
                                                    extra_body=extra)
        assert resp.choices[0].message.content == "ok"
        assert want in tok.decode(list(engine.prompts[-1]))


async def test_raw_reply_and_tool_choice(harness, scripted):
    engine = scripted((TEMPLATES / "qwen3.jinja").read_text(), QWEN_REPLY)
    client = harness.openai()
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=32)
    raw = await client.chat.completions.create(**kwargs, extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content == QWEN_REPLY
    assert raw.choices[0].message.tool_calls is None and raw.choices[0].finish_reason == "stop"
    assert (await streamed(client, **kwargs, extra_body={"reasoning_format": "none"}))[0] == (
        QWEN_REPLY)
    # tool_choice "none": the tools stay out of the prompt, the reply's markup stays text
    none = (await client.chat.completions.create(**kwargs, tool_choice="none")).choices[0]
    prompt = harness.state.router.get(None).tokenizer.decode(list(engine.prompts[-1]))
    assert "get_weather" not in prompt
    assert none.message.tool_calls is None and "<tool_call>" in none.message.content
    assert none.message.reasoning_content == "They want the weather."
    resp = await harness.http.post("/v1/chat/completions", headers=harness.auth(), json={
        "messages": ASK, "reasoning_format": "deepseek"})
    assert_openai_error(resp, 400)


# bounded strings: a random-weight model would write an unbounded one until max_tokens
FORCED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"city": {"type": "string", "maxLength": 12}}}}},
                {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm",
    "parameters": {"type": "object", "required": ["hour", "label"],
                   "additionalProperties": False, "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "label": {"$ref": "#/$defs/Label"}},
                   "$defs": {"Label": {"type": "string", "maxLength": 12}}}}}]


LLAMA_CPP_TEMPLATES = {"gpt-oss": "openai-gpt-oss-120b",
                       "mistral-small-3.2": "Mistral-Small-3.2-24B-Instruct-2506",
                       "mistral-nemo": "mistralai-Mistral-Nemo-Instruct-2407"}


@pytest.mark.parametrize("template", ["qwen3", "llama-3.1", *LLAMA_CPP_TEMPLATES])
async def test_required_and_named_tool_calls_are_forced(harness, monkeypatch, llama_vendor,
                                                        template):
    """The random-weight model must call a tool when tool_choice says so: a grammar writes
    the call in the template's own markup, and the reply parses back to a call whose
    arguments meet the function's schema; the call sent back renders (Mistral's templates
    refuse ids that are not 9 letters and digits)."""
    if template in LLAMA_CPP_TEMPLATES:
        path = llama_vendor / "models" / "templates" / f"{LLAMA_CPP_TEMPLATES[template]}.jinja"
    else:
        path = TEMPLATES / f"{template}.jinja"
    source = path.read_text()
    loaded = harness.state.router.get(None).engine.loaded
    monkeypatch.setattr(loaded, "chat_template",
                        ChatTemplate(source, bos_token="<s>", eos_token="</s>"))
    client = harness.openai()
    kwargs = dict(model="tiny", messages=ASK, tools=FORCED_TOOLS, max_tokens=120, seed=1,
                  temperature=1.0)
    if template == "qwen3":  # no reasoning first: a random model would not close it
        kwargs["extra_body"] = {"chat_template_kwargs": {"enable_thinking": False}}
    named = {"type": "function", "function": {"name": "set_alarm"}}
    for choice, names in (("required", {"get_weather", "set_alarm"}), (named, {"set_alarm"})):
        for stream in (False, True):
            if stream:
                _, _, calls, finish = await streamed(client, **kwargs, tool_choice=choice)
                calls = [(n, a) for _, n, a in calls]
            else:
                resp = (await client.chat.completions.create(**kwargs, tool_choice=choice)
                        ).choices[0]
                calls = [(c.function.name, c.function.arguments)
                         for c in resp.message.tool_calls or ()]
                finish = resp.finish_reason
            assert finish == "tool_calls" and len(calls) == 1, (choice, stream, calls)
            name, arguments = calls[0]
            args = json.loads(arguments)
            assert name in names
            if name == "set_alarm":
                assert set(args) == {"hour", "label"} and 0 <= args["hour"] <= 23
                assert isinstance(args["label"], str) and len(args["label"]) <= 12
            else:
                assert set(args) <= {"city"}
    history = [*ASK, resp.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": resp.message.tool_calls[0].id, "content": "ok"}]
    again = await client.chat.completions.create(**{**kwargs, "messages": history},
                                                 tool_choice="none")
    assert again.choices[0].finish_reason in ("stop", "length")


async def test_tool_choice_errors(harness):
    bad = [({"tool_choice": "required"}, "tool_choice"),  # no tools
           ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
           ({"tools": TOOLS, "tool_choice": {"type": "function",
                                             "function": {"name": "nope"}}}, "tool_choice"),
           ({"tools": [{"type": "function", "function": {"name": "a b"}}],
             "tool_choice": "required"}, "tools"),
           ({"tools": TOOLS, "tool_choice": "required",
             "response_format": {"type": "json_object"}}, "tool_choice"),
           # the tiny model's built-in Llama 3 template has no tool-call format
           ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice")]
    for extra, param in bad:
        resp = await harness.http.post("/v1/chat/completions", headers=harness.auth(),
                                       json={"messages": ASK, **extra})
        assert assert_openai_error(resp, 400)["param"] == param, extra


async def test_plain_models_stream_as_before(harness, scripted):
    # the tiny model's own (built-in Llama 3) template: no markup to parse
    handle = harness.state.router.get(None)
    engine = scripted(handle.chat_template.source, "<think>a</think> {\"b\": 1}")
    client = harness.openai()
    whole = (await client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
             ).choices[0]
    assert whole.message.content == engine.reply and whole.finish_reason == "stop"
    assert getattr(whole.message, "reasoning_content", None) is None


async def test_a_forced_qwen3_coder_call(harness, monkeypatch, llama_vendor):
    """Qwen3-Coder's XML call forced on the random-weight model (enum and integer
    parameters: a text one would run to max_tokens on random weights); it parses back to
    arguments of the declared types."""
    source = (llama_vendor / "models" / "templates" / "Qwen3-Coder.jinja").read_text()
    loaded = harness.state.router.get(None).engine.loaded
    monkeypatch.setattr(loaded, "chat_template",
                        ChatTemplate(source, bos_token="<s>", eos_token="</s>"))
    tools = [{"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "required": ["hour"], "properties": {
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "sound": {"type": "string", "enum": ["bell", "chime"]},
            "snooze": {"type": "boolean"}}}}}]
    client = harness.openai()
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=ASK, tools=tools, max_tokens=80, seed=2,
                      temperature=1.0, tool_choice="required")
        if stream:
            _, _, calls, finish = await streamed(client, **kwargs)
            calls = [(n, a) for _, n, a in calls]
        else:
            resp = (await client.chat.completions.create(**kwargs)).choices[0]
            calls = [(c.function.name, c.function.arguments) for c in resp.message.tool_calls]
            finish = resp.finish_reason
        assert finish == "tool_calls" and len(calls) == 1 and calls[0][0] == "set_alarm"
        args = json.loads(calls[0][1])
        assert set(args) <= {"hour", "sound", "snooze"} and 0 <= args["hour"] <= 23
        assert args.get("sound", "bell") in ("bell", "chime")
        assert isinstance(args.get("snooze", False), bool)
