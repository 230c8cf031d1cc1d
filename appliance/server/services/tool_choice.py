"""tool_choice "required" or a named function: a grammar that makes the reply one call.

The call is written in the model's own markup, the one its chat template teaches and
replies.py parses back:
- Hermes / Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- Llama 3.1: `{"name": ..., "parameters": {...}}`;
- Mistral: `[TOOL_CALLS]NAME[ARGS]{...}`, or `[TOOL_CALLS][{"name": ..., "arguments": ...}]`;
- Qwen3-Coder: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>...`;
- harmony (gpt-oss): `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`
  and the arguments; the end of the message (`<|call|>`) is an end-of-generation token,
  which the grammar allows once the arguments are complete.

The arguments follow the function's `parameters` JSON schema. A marker the vocabulary
holds as one token is that token (`<[id]>` in llguidance's grammar syntax), as the model
was trained to write it; otherwise its text.
"""

from __future__ import annotations

import json
from typing import Any

from appliance.server.errors import BadRequest, Unsupported
from appliance.server.services.replies import CALL_NAME, tool_markup
from engine.grammar import lark_grammar

MAX_SCHEMA_CHARS = 1 << 18
# compact JSON, as engine/grammar.py's response formats: with free whitespace a small model
# can loop on spaces and newlines
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


def forced_tool(tool_choice: Any, tools: list[dict[str, Any]] | None) -> str | None:
    """None: the model may answer as it likes; "": it must call one of `tools`; a name: it
    must call that function. Refuses what OpenAI's API does not define."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        name = ""
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)
          and isinstance(tool_choice["function"].get("name"), str)):
        name = tool_choice["function"]["name"]
    else:
        raise BadRequest('tool_choice must be "auto", "none", "required" or {"type": '
                         '"function", "function": {"name": ...}}', param="tool_choice")
    if not tools:
        raise BadRequest("tool_choice asks for a call but the request has no tools",
                         param="tool_choice")
    if name and name not in {f["name"] for f in _functions(tools)}:
        raise BadRequest(f"tool_choice names {name[:64]!r}, which is not among the tools",
                         param="tool_choice")
    return name


def forced_call_grammar(template: str, tokenizer: Any, tools: list[dict[str, Any]],
                        name: str, thinking: str = "none") -> str:
    """llguidance grammar text for one call of `name` ("": any of the tools), after the
    reasoning `thinking` allows (engine/grammar.py's THINK_MODES)."""
    functions = [f for f in _functions(tools) if not name or f["name"] == name]
    markup = tool_markup(template)
    if markup is None:
        raise Unsupported("this model's chat template has no tool-call format, so a call "
                          "cannot be required", param="tool_choice")

    def marker(text: str) -> str:
        tid = tokenizer.special_token_id(text)
        return f"<[{tid}]>" if tid is not None else json.dumps(text)

    calls, extra = [], []
    for i, f in enumerate(functions):
        params = _schema(f)
        if markup == "qwen3_xml":
            body, rules = _xml_call(i, f["name"], params)
            calls.append(f'{marker("<tool_call>")} {body} {marker("</tool_call>")}')
            extra += rules
            continue
        if markup == "harmony":
            calls.append(f'{marker("<|channel|>")} "commentary to=functions.{f["name"]} " '
                         f'{marker("<|constrain|>")} "json" {marker("<|message|>")} '
                         f'%json {json.dumps({**params, **_COMPACT})}')
            continue
        if markup == "mistral_args":
            calls.append(f'{marker("[TOOL_CALLS]")} "{f["name"]}" {marker("[ARGS]")} '
                         f'%json {json.dumps({**params, **_COMPACT})}')
            continue
        key = "parameters" if markup == "llama_json" else "arguments"
        # "#/$defs/..." references point at the root: the definitions move up with them
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        inner = {k: v for k, v in params.items() if k not in defs}
        schema = json.dumps({"type": "object", "properties": {
            "name": {"const": f["name"]}, key: inner},
            "required": ["name", key], "additionalProperties": False, **defs, **_COMPACT})
        if markup == "llama_json":
            calls.append(f"%json {schema}")
        elif markup == "mistral_json":
            calls.append(f'{marker("[TOOL_CALLS]")} "[" %json {schema} "]"')
        else:
            calls.append(f'{marker("<tool_call>")} "\\n" %json {schema} "\\n" '
                         f'{marker("</tool_call>")}')
    rules = "".join(f"call{i}: {c}\n" for i, c in enumerate(calls)) + "".join(extra)
    return lark_grammar(" | ".join(f"call{i}" for i in range(len(calls))), rules, thinking)


def _xml_call(i: int, name: str, params: dict[str, Any]) -> tuple[str, list[str]]:
    r"""Qwen3-Coder's `\n<function=NAME>\n<parameter=KEY>\nvalue\n</parameter>\n...
    </function>\n` (what its template renders), every declared parameter in order (the
    optional ones may be left out): a text parameter as free text up to its closing tag
    (one of its `enum` where it has one), any other as JSON of its schema."""
    props = params.get("properties") or {}
    if not isinstance(props, dict):
        raise BadRequest(f"the parameters of {name} must list their properties as an object",
                         param="tools")
    required = set(params.get("required") or ())
    close = json.dumps("\n</parameter>\n")  # every literal as a JSON string: lark's escapes
    parts, rules = [], []
    for j, (key, schema) in enumerate(props.items()):
        if not CALL_NAME.fullmatch(key):
            raise BadRequest(f"parameter {key[:64]!r} of {name}: letters, digits, _ . - "
                             f"only", param="tools")
        schema = schema if isinstance(schema, dict) else {}
        head = json.dumps(f"<parameter={key}>\n")
        if schema.get("type") == "string" and isinstance(schema.get("enum"), list):
            value = "(" + " | ".join(json.dumps(str(v)) for v in schema["enum"]) + ")"
            part = f"{head} {value} {close}"
        elif schema.get("type") == "string":  # free text; its stop string is the close
            rules.append(f"text{i}_{j}[stop={close}]: /(.|\\n)*/\n")
            part = f"{head} text{i}_{j}"
        else:
            part = f"{head} %json {json.dumps({**schema, **_COMPACT})} {close}"
        rules.append(f"param{i}_{j}: {part}\n")
        parts.append(f"param{i}_{j}" + ("" if key in required else "?"))
    body = " ".join([json.dumps(f"\n<function={name}>\n"), *parts,
                     json.dumps("</function>\n")])
    return body, rules


def _functions(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for tool in tools or ():
        f = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(f, dict) or tool.get("type", "function") != "function" or \
                not isinstance(f.get("name"), str):
            raise BadRequest('each tool must be {"type": "function", "function": {"name": '
                             '...}}', param="tools")
        if not CALL_NAME.fullmatch(f["name"]):
            raise BadRequest(f"tool name {f['name'][:64]!r}: letters, digits, _ . - only, "
                             f"at most 64", param="tools")
        out.append(f)
    return out


def _schema(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters", {"type": "object"})
    if not isinstance(params, dict):
        raise BadRequest(f"the parameters of {function['name']} must be a JSON schema object",
                         param="tools")
    if len(json.dumps(params)) > MAX_SCHEMA_CHARS:
        raise BadRequest(f"the parameters of {function['name']} exceed {MAX_SCHEMA_CHARS} "
                         f"characters", param="tools")
    return params or {"type": "object"}
