"""Replies split into reasoning, content and tool calls (appliance/server/services/replies.py).

Each markup is checked three ways: on replies written the way the families write them,
fed whole, a character at a time and cut at every point (the parts must not depend on how
the text streams); on what the models' own chat templates (llama.cpp's copies of the
published templates) render for a tool call, which must parse back to the same call;
and on broken markup, which must come out verbatim as content.
"""

from __future__ import annotations

import json

import pytest

from appliance.server.services.replies import (
    HarmonyReply,
    JsonToolReply,
    MistralReply,
    PlainReply,
    TaggedReply,
    reply_parser_factory,
)
from engine.tokenizer.chat import ChatTemplate

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def run(make, pieces):
    parser = make()
    content, reasoning, calls = "", "", []
    for piece in [*pieces, None]:
        parts = parser.feed(piece) if piece is not None else parser.finish()
        content += parts.content
        reasoning += parts.reasoning
        calls += [(c.name, json.loads(c.arguments)) for c in parts.tool_calls]
    return content, reasoning, calls


def parse_every_way(make, text):
    """The parts of `text`, the same whole, a character at a time, and cut anywhere."""
    whole = run(make, [text])
    assert run(make, list(text)) == whole, "a character at a time"
    for cut in range(1, len(text)):
        assert run(make, [text[:cut], text[cut:]]) == whole, f"cut at {cut}"
    return whole


def tagged(**kwargs):
    return lambda: TaggedReply(**kwargs)


def test_think_tags_split_reasoning_from_content():
    make = tagged(think=True, tools=False)
    text = "<think>\nThe user wants 2+2.\nThat is 4.\n</think>\n\nIt is 4.\n"
    assert parse_every_way(make, text) == ("It is 4.\n", "The user wants 2+2.\nThat is 4.", [])


def test_a_reply_that_starts_inside_the_reasoning():
    # DeepSeek-R1's and the Qwen3 thinking templates open <think> in the prompt
    make = tagged(think=True, tools=False, in_reasoning=True)
    assert parse_every_way(make, "Hmm, 4.\n</think>\n\n4") == ("4", "Hmm, 4.", [])
    # cut short by max_tokens: what came is reasoning, nothing is lost
    assert parse_every_way(make, "Still thinking <thi") == ("", "Still thinking <thi", [])


def test_hermes_tool_calls_with_content_and_reasoning():
    make = tagged(think=True, tools=True)
    text = ('<think>\nNeed weather.\n</think>\n\nLet me look.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Nice\\"}"}'
            '\n</tool_call>')
    assert parse_every_way(make, text) == (
        "Let me look.", "Need weather.",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Nice"})])


def test_broken_markup_comes_out_verbatim():
    make = tagged(think=False, tools=True)
    bad = "<tool_call>\n{\"name\": get_weather}\n</tool_call>"
    assert parse_every_way(make, "a < b " + bad + " ok") == ("a < b " + bad + " ok", "", [])
    # a '<' that starts no marker, and a marker's prefix at the very end
    assert parse_every_way(make, "x <tool y <tool_ca") == ("x <tool y <tool_ca", "", [])
    # a call whose closing tag never came (the model stopped) still parses
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert parse_every_way(make, cut) == ("", "", [("get_weather", {"city": "Rome"})])
    assert parse_every_way(make, "<tool_call>\n{\"na") == ("<tool_call>\n{\"na", "", [])


def test_indentation_after_a_marker_is_kept():
    make = tagged(think=True, tools=False)
    text = "<think>\nCode.\n</think>\n\n    return 4\n"
    assert parse_every_way(make, text) == ("    return 4\n", "Code.", [])
    assert parse_every_way(HarmonyReply, "<|channel|>final<|message|>  x = 1") == (
        "  x = 1", "", [])


def test_think_tags_are_text_when_the_template_has_none():
    make = tagged(think=False, tools=True)
    text = "<think>x</think> y"
    assert parse_every_way(make, text) == (text, "", [])


def test_harmony_channels_and_a_tool_call():
    text = ("<|channel|>analysis<|message|>User asks weather. Call tool.<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_weather "
            '<|constrain|>json<|message|>{"city": "Paris"}')  # <|call|> stops: never text
    assert parse_every_way(HarmonyReply, text) == (
        "", "User asks weather. Call tool.", [("get_weather", {"city": "Paris"})])
    text = ("<|channel|>analysis<|message|>Simple.<|end|><|start|>assistant"
            "<|channel|>final<|message|>Hello there.")
    assert parse_every_way(HarmonyReply, text) == ("Hello there.", "Simple.", [])
    # the recipient before the channel, as the template renders calls
    text = (' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}'
            "<|call|>")
    assert parse_every_way(HarmonyReply, text) == ("", "", [("get_weather", {"city": "Oslo"})])
    # a call cut short (max_tokens) is the message as written
    text = '<|channel|>commentary to=functions.get_weather json<|message|>{"city": "Os'
    assert parse_every_way(HarmonyReply, text) == (text, "", [])
    # a preamble on the commentary channel is content
    text = "<|channel|>commentary<|message|>Checking.<|end|>"
    assert parse_every_way(HarmonyReply, text) == ("Checking.", "", [])


def test_text_that_is_not_harmony_is_kept():
    assert parse_every_way(HarmonyReply, "Just text, no header.") == (
        "Just text, no header.", "", [])
    long = "word " * 300  # past the longest header: streamed as content
    parser = HarmonyReply()
    assert parser.feed(long).content and run(HarmonyReply, [long]) == (long, "", [])


def test_llama_json_tool_calls():
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_every_way(JsonToolReply, call) == ("", "", [("get_weather", {"city": "Paris"})])
    two = '<|python_tag|>' + call + '; {"name": "get_weather", "parameters": {"city": "Lyon"}}'
    assert parse_every_way(JsonToolReply, two) == (
        "", "", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})])
    assert parse_every_way(JsonToolReply, '{"a": 1} is JSON') == ('{"a": 1} is JSON', "", [])
    deep = "[" * 5000  # past the JSON decoder's recursion limit: text, not an error
    assert run(JsonToolReply, ["{" + deep]) == ("{" + deep, "", [])
    # plain text streams at once, not at the end
    parser = JsonToolReply()
    assert parser.feed(" Sunny").content == " Sunny"


def test_qwen3_coder_xml_tool_calls():
    """Values read by their parameter's schema type: text, integers, booleans as the
    template writes them (Python's True), objects as JSON; no schema: JSON, else text."""
    schemas = {"f": {"type": "object", "properties": {
        "s": {"type": "string"}, "n": {"type": "integer"}, "b": {"type": "boolean"},
        "o": {"type": "object"}}}}
    make = tagged(think=True, tools=True, schemas=schemas)
    text = ("<think>\nx\n</think>\n\nOk.\n<tool_call>\n<function=f>\n<parameter=s>\n42\n"
            "</parameter>\n<parameter=n>\n42\n</parameter>\n<parameter=b>\nTrue\n"
            "</parameter>\n<parameter=o>\n{\"a\": [1]}\n</parameter>\n<parameter=free>\n"
            "two\nlines\n</parameter>\n</function>\n</tool_call>")
    assert parse_every_way(make, text) == ("Ok.", "x", [("f", {
        "s": "42", "n": 42, "b": True, "o": {"a": [1]}, "free": "two\nlines"})])
    bad = ("<tool_call>\n<function=f>\nstray<parameter=s>\n1\n</parameter>\n</function>\n"
           "</tool_call>")
    assert parse_every_way(make, bad) == (bad, "", [])


def test_mistral_tool_calls():
    text = ('Let me check. [TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris"}'
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Lyon"}')
    assert parse_every_way(MistralReply, text) == (
        "Let me check.", "",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Lyon"})])
    parser = MistralReply()
    parser.feed(text)
    ids = [c.id for c in parser.finish().tool_calls]
    assert ids[0] == "abcDEF123" and len(ids[1]) == 9 and ids[1].isalnum()  # as templates need
    nemo = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "x1"}]'
    assert parse_every_way(MistralReply, nemo) == ("", "", [("get_weather", {"city": "Rome"})])
    for bad in ('[TOOL_CALLS]get weather[ARGS]{}', '[TOOL_CALLS]f[ARGS]{"a": ',
                '[TOOL_CALLS][{"arguments": {}}]', 'a [TOOL_CALLS]f'):
        assert parse_every_way(MistralReply, bad) == (bad, "", [])
    assert parse_every_way(MistralReply, "No calls [TOOL") == ("No calls [TOOL", "", [])


def template_reply_text(template: ChatTemplate, start: str, end: str) -> str:
    """The assistant turn a template renders for a tool call: between the last `start`
    and the `end` after it."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": "abcDEF123", "type": "function",  # Mistral's: 9 letters and digits
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"}]
    text = template.render(messages, add_generation_prompt=False, tools=TOOLS)
    at = text.index("Paris?")
    body = text[text.index(start, at) + len(start):]
    return body[:body.index(end)]


@pytest.mark.parametrize("name, start, end, kind", [
    ("Qwen-Qwen3-0.6B", "<|im_start|>assistant\n", "<|im_end|>", TaggedReply),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "<|im_start|>assistant\n", "<|im_end|>",
     TaggedReply),
    ("openai-gpt-oss-120b", "<|start|>assistant", "<|call|>", HarmonyReply),
    ("meta-llama-Llama-3.1-8B-Instruct", "<|start_header_id|>assistant<|end_header_id|>\n\n",
     "<|eot_id|>", JsonToolReply),
    ("Mistral-Small-3.2-24B-Instruct-2506", "[/INST]", "</s>", MistralReply),
    ("unsloth-mistral-Devstral-Small-2507", "[/INST]", "</s>", MistralReply),
    ("mistralai-Mistral-Nemo-Instruct-2407", "[/INST]", "</s>", MistralReply),
    ("Qwen3-Coder", "<|im_start|>assistant\n", "<|im_end|>", TaggedReply),
])
def test_a_templates_own_tool_call_parses_back(llama_vendor, name, start, end, kind):
    source = (llama_vendor / "models" / "templates" / f"{name}.jinja").read_text()
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "Hi"}], tools=TOOLS)
    make = reply_parser_factory(source, prompt, tools=TOOLS)
    assert isinstance(make(), kind)
    reply = template_reply_text(template, start, end)
    assert run(make, [reply]) == ("", "", [("get_weather", {"city": "Paris"})]), reply


@pytest.mark.parametrize("name, in_reasoning", [
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", True), ("Qwen-Qwen3-0.6B", False)])
def test_think_templates_start_where_their_prompt_leaves_off(llama_vendor, name, in_reasoning):
    source = (llama_vendor / "models" / "templates" / f"{name}.jinja").read_text()
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    prompt = template.render([{"role": "user", "content": "Hi"}])
    make = reply_parser_factory(source, prompt, tools=None)
    reply = "Hmm.\n</think>\n\nHi!" if in_reasoning else "<think>\nHmm.\n</think>\n\nHi!"
    assert run(make, [reply]) == ("Hi!", "Hmm.", [])
    # Qwen3 without thinking: the template closes an empty think block in the prompt
    if name.startswith("Qwen"):
        prompt = template.render([{"role": "user", "content": "Hi"}], enable_thinking=False)
        assert prompt.endswith("</think>\n\n")
        assert run(reply_parser_factory(source, prompt, tools=None), ["Hi!"]) == ("Hi!", "", [])


def test_plain_families_and_the_switches(llama_vendor):
    gemma = (llama_vendor / "models" / "templates" / "google-gemma-2-2b-it.jinja").read_text()
    assert reply_parser_factory(gemma, "", tools=TOOLS) is PlainReply
    qwen = (llama_vendor / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert reply_parser_factory(qwen, "", tools=TOOLS, parse=False) is PlainReply
    # no tools offered: a <tool_call> the model writes anyway stays content
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert run(reply_parser_factory(qwen, "", tools=None), [text]) == (text, "", [])


def test_forced_calls_need_a_format_a_grammar_writes(llama_vendor):
    from appliance.server.errors import ApiError
    from appliance.server.services.tool_choice import forced_call_grammar

    class Vocab:
        def special_token_id(self, text):
            return None

    gemma = (llama_vendor / "models" / "templates" / "google-gemma-2-2b-it.jinja").read_text()
    with pytest.raises(ApiError) as exc:  # no tool-call format
        forced_call_grammar(gemma, Vocab(), TOOLS, "")
    assert exc.value.status == 400 and exc.value.param == "tool_choice"
    qwen = (llama_vendor / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    grammar = forced_call_grammar(qwen, Vocab(), TOOLS, "get_weather")
    assert '"<tool_call>"' in grammar and '"get_weather"' in grammar


@pytest.fixture(scope="module")
def qwen_vocab(vocab_dir):
    """Qwen's tokenizer (llama.cpp's test vocabulary)."""
    import sys
    from pathlib import Path

    from engine.tokenizer import Tokenizer

    sys.path.insert(0, str(Path(__file__).parents[2] / "engine" / "tokenizer"))
    from tokenizer_meta import read_tokenizer_metadata

    return Tokenizer.from_metadata(read_tokenizer_metadata(vocab_dir / "ggml-vocab-qwen2.gguf"))


def accepts(tok, grammar: str, reply: str) -> bool:
    """Whether llguidance's matcher takes the whole reply, token by token, and ends there."""
    import llguidance

    from engine.grammar import grammar_tokenizer

    m = llguidance.LLMatcher(grammar_tokenizer(tok).ll, grammar, log_level=0)
    ids = tok.encode(reply, add_special=False, parse_special=False)
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


@pytest.mark.parametrize("prompt_end, mode", [("<|im_start|>assistant\n", "optional"),
                                              ("<think>\n\n</think>\n\n", "none"),
                                              ("<|Assistant|><think>\n", "open")])
def test_grammars_let_a_thinking_model_reason_first(llama_vendor, qwen_vocab, prompt_end, mode):
    """A forced call or a JSON format after the reasoning the prompt leaves room for: a
    block the model may open (Qwen3), none (thinking off), or one the prompt opened
    (DeepSeek-R1); checked by llguidance's matcher on whole replies."""
    from appliance.server.services.replies import thinking_mode
    from appliance.server.services.tool_choice import forced_call_grammar
    from engine.grammar import json_body, lark_grammar

    qwen = (llama_vendor / "models" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert thinking_mode(qwen, "..." + prompt_end) == mode
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    reasoning = "<think>\nThe user wants {json} and </thin.\n</think>\n\n"
    if mode == "open":
        reasoning = reasoning[len("<think>"):]
    grammars = {call: forced_call_grammar(qwen, qwen_vocab, TOOLS, "", mode),
                '{"a":1}': lark_grammar(json_body({"type": "object"}), "", mode)}
    for answer, grammar in grammars.items():
        for reply, ok in ((answer, mode != "open"), (reasoning + answer, mode != "none"),
                          ("Sure: " + answer, False)):
            assert accepts(qwen_vocab, grammar, reply) == ok, reply


def test_a_forced_qwen3_coder_call_is_what_its_template_renders(llama_vendor, qwen_vocab):
    """The XML grammar accepts the call Qwen3-Coder's own template writes (text, integer
    and enum parameters, an optional one left out) and refuses an undeclared parameter."""
    from appliance.server.services.tool_choice import forced_call_grammar

    tools = [{"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "required": ["city", "nights"], "properties": {
            "city": {"type": "string"}, "nights": {"type": "integer"},
            "room": {"type": "string", "enum": ["single", "double"]},
            "note": {"type": "string"}}}}}]
    source = (llama_vendor / "models" / "templates" / "Qwen3-Coder.jinja").read_text()
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    args = {"city": "New\nYork </param", "nights": 3, "room": "double"}
    text = template.render([{"role": "user", "content": "Book"}, {
        "role": "assistant", "content": "", "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "book", "arguments": json.dumps(args)}}]}],
        add_generation_prompt=False, tools=tools)
    reply = text[text.rindex("<tool_call>"):text.rindex("</tool_call>") + len("</tool_call>")]
    grammar = forced_call_grammar(source, qwen_vocab, tools, "book")
    assert accepts(qwen_vocab, grammar, reply)
    assert not accepts(qwen_vocab, grammar, reply.replace("<parameter=room>",
                                                           "<parameter=view>"))
    make = reply_parser_factory(source, "", tools=tools)
    assert run(make, [reply]) == ("", "", [("book", args)])
