"""Typed request bodies (msgspec Structs with constraints) and the one decoder for them.

OpenAI's fields keep OpenAI's names and ranges; extensions (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `chat_template_kwargs`) follow vLLM.
Unknown fields are ignored and logged, never rejected, so newer clients keep working.
Numbers are bounded here, so no later stage sees an infinite temperature or a 10^30 token
count; what depends on the model (context, vocabulary) is checked by the service.
"""

from __future__ import annotations

import logging
import re
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from appliance.server.errors import BadRequest

log = logging.getLogger(__name__)

T = TypeVar("T", bound=Struct)

Name = Annotated[str, Meta(min_length=1, max_length=256)]
Text = Annotated[str, Meta(max_length=1 << 24)]
TokenCount = Annotated[int, Meta(ge=1, le=1 << 22)]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
StopList = Annotated[list[Annotated[str, Meta(max_length=1024)]], Meta(max_length=16)]
TokenIds = Annotated[list[Annotated[int, Meta(ge=0, le=(1 << 31) - 1)]], Meta(max_length=1 << 22)]
KvQuant = Literal["f16", "q8", "k8v4", "k4v8", "k4v4"]


class Message(Struct):
    role: Annotated[str, Meta(min_length=1, max_length=64)]
    content: Text | Annotated[list[dict[str, Any]], Meta(max_length=4096)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[dict[str, Any]], Meta(max_length=256)] | None = None
    tool_call_id: Name | None = None
    reasoning_content: Text | None = None  # an earlier reply's reasoning, sent back

    def __post_init__(self) -> None:
        # OpenAI's API: only an assistant message may leave its content out (a tool call)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role[:64]!r} message needs `content`")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        if self.reasoning_content is not None:
            out["thinking"] = self.reasoning_content  # what harmony templates read
        return out


class JsonSchemaFormat(Struct):
    name: Name = "response"
    schema: dict[str, Any] | None = None
    description: Text | None = None
    strict: bool | None = None


class ResponseFormat(Struct):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Struct):
    include_usage: bool = False


class SamplingFields(Struct, kw_only=True):
    """What chat and text completions share."""

    model: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=0, le=1 << 22)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=1 << 24)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] | None = None
    seed: Seed | None = None
    stop: Annotated[str, Meta(max_length=1024)] | StopList | None = None
    stop_token_ids: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=64)] | None = None
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    ignore_eos: bool = False
    logit_bias: Annotated[dict[str, Any], Meta(max_length=1 << 16)] | None = None
    user: Annotated[str, Meta(max_length=1024)] | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Annotated[list[Message], Meta(min_length=1, max_length=4096)]
    max_completion_tokens: TokenCount | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[dict[str, Any]], Meta(max_length=256)] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # "auto": reasoning and tool calls split out of the reply (replies.py); "none": raw text
    reasoning_format: Literal["auto", "none"] = "auto"
    # OpenAI's; reaches the chat template as `reasoning_effort` (gpt-oss: "Reasoning: low")
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    # str | token ids | a batch of either (msgspec allows one array type: checked below)
    prompt: Text | Annotated[list[Any], Meta(min_length=1, max_length=1 << 22)]
    echo: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    suffix: Text | None = None
    best_of: Annotated[int, Meta(ge=1, le=16)] | None = None


class EmbeddingRequest(Struct, kw_only=True):
    model: Name | None = None
    # a text, texts, token ids, or lists of token ids (msgspec allows one array type:
    # services/embeddings.py checks the items)
    input: Text | Annotated[list[Any], Meta(min_length=1, max_length=2048)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Meta(ge=1, le=1 << 16)] | None = None
    user: Annotated[str, Meta(max_length=1024)] | None = None


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's /tokenize: a text, or chat messages rendered by the model's template."""

    model: Name | None = None
    prompt: Text | None = None
    messages: Annotated[list[Message], Meta(min_length=1, max_length=4096)] | None = None
    add_special_tokens: bool = True  # a text's BOS (the template writes a chat's own)
    add_generation_prompt: bool = True
    tools: Annotated[list[dict[str, Any]], Meta(max_length=256)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class DetokenizeRequest(Struct, kw_only=True):
    model: Name | None = None
    tokens: TokenIds


class ModelRef(Struct):
    name: Annotated[str, Meta(min_length=1, max_length=4096)]
    sessions: Annotated[int, Meta(ge=1, le=4096)] | None = None
    context: Annotated[int, Meta(ge=16, le=1 << 21)] | None = None
    kv_quant: KvQuant | None = None


class AddModel(Struct):
    path: Annotated[str, Meta(min_length=1, max_length=4096)]
    name: Name | None = None
    sessions: Annotated[int, Meta(ge=1, le=4096)] | None = None
    context: Annotated[int, Meta(ge=16, le=1 << 21)] | None = None
    kv_quant: KvQuant | None = None


Limit = Annotated[int, Meta(ge=1, le=1 << 40)]
Count = Annotated[int, Meta(ge=1, le=1 << 20)]


class QuotaPatch(Struct):
    """A key's quota fields to set; absent fields keep their value, null = unlimited."""

    allowed_models: Annotated[list[Name], Meta(max_length=1024)] | None | UnsetType = UNSET
    max_pending: Count | UnsetType = UNSET
    max_concurrent_streams: Count | UnsetType = UNSET
    requests_per_min: Limit | None | UnsetType = UNSET
    tokens_per_min: Limit | None | UnsetType = UNSET
    tokens_per_day: Limit | None | UnsetType = UNSET
    expires_at: Annotated[datetime, Meta(tz=True)] | None | UnsetType = UNSET

    def fields(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__struct_fields__
               if getattr(self, k) is not UNSET}
        if out.get("allowed_models") is not None:
            out["allowed_models"] = tuple(out["allowed_models"])
        return out


class CreateKey(Struct):
    name: Name
    user: Name
    role: Literal["admin", "user"] = "user"
    quota: QuotaPatch | None = None


_AT = re.compile(r"at `\$\.?([^`]*)`")


def decode_body(body: bytes, schema: type[T]) -> T:
    """JSON bytes -> a validated `schema`; BadRequest (400) names the offending field."""
    try:
        data = msgspec.json.decode(body)
    except RecursionError:
        raise BadRequest("the JSON body is nested too deeply") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    except msgspec.ValidationError as exc:  # e.g. a number out of range
        raise BadRequest(f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    unknown = data.keys() - set(schema.__struct_fields__)
    if unknown:
        log.info("ignoring unknown fields: %s", ", ".join(repr(k[:64]) for k in
                                                          sorted(unknown)[:16]))
    try:
        return msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        match = _AT.search(str(exc))
        raise BadRequest(str(exc), param=match.group(1) if match else None) from None
    except RecursionError:
        raise BadRequest("the JSON body is nested too deeply") from None
