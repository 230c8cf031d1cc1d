"""Chat and text completion requests -> generation jobs.

The service resolves the model (404), checks the key may use it (403), builds the prompt
(chat template, or text / token ids), checks prompt + max_tokens against the context
(400 with the numbers), builds one SamplingParams per choice (seed + i for choice i) and
hands the job to the GenerationService. Templating and tokenizing run in a worker
thread: a long prompt must not stall other streams' events.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from typing import Any

from litestar import Response

from appliance.auth import Principal, check_model_allowed
from appliance.server.errors import BadRequest, Unsupported
from appliance.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from appliance.server.services.formats import CHAT, TEXT
from appliance.server.services.generation import Choice, GenerationService, Job
from appliance.server.services.replies import reply_parser_factory, thinking_mode
from appliance.server.services.tool_choice import forced_call_grammar, forced_tool
from engine.sampler import validate_params
from engine.sampling_params import SamplingParams
from engine.scheduler.request import Request

MAX_CHOICES = 64  # prompts x n of one request
DEFAULT_ESTIMATE = 256  # output tokens a request without max_tokens is assumed to use
TEXT_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat: the context)


class CompletionService:
    def __init__(self, router: Any, generation: GenerationService) -> None:
        self.router = router
        self.generation = generation

    async def chat(self, principal: Principal, body: ChatCompletionRequest,
                   receive: Any) -> Response:
        handle = self.router.get(body.model)
        check_model_allowed(principal, handle.name)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens == 0:
            raise BadRequest("max_tokens must be at least 1", param="max_tokens")
        forced = forced_tool(body.tool_choice, body.tools)  # before any work: 400s first
        offers_tools = bool(body.tools) and body.tool_choice != "none"
        prompt, text = await asyncio.to_thread(chat_prompt, handle, body, offers_tools)
        _check_context(handle, [prompt], max_tokens, "messages")
        top = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        params = _sampling(body, max_tokens, top, handle.vocab_size)
        grammar = await _grammar_factory(
            handle, body, forced, thinking_mode(handle.chat_template.source, text))
        job = _job("chat", handle, principal, [prompt], params, body.n, grammar)
        job.logprobs = top
        job.include_usage = bool(body.stream and body.stream_options
                                 and body.stream_options.include_usage)
        job.reply_parser = reply_parser_factory(
            handle.chat_template.source, text, tools=body.tools if offers_tools else None,
            parse=body.reasoning_format == "auto")
        return await self.generation.run(job, CHAT, receive, body.stream)

    async def text(self, principal: Principal, body: CompletionRequest,
                   receive: Any) -> Response:
        handle = self.router.get(body.model)
        check_model_allowed(principal, handle.name)
        if body.best_of is not None and body.best_of != body.n:
            raise Unsupported("best_of other than n is not supported", param="best_of")
        max_tokens = TEXT_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        if max_tokens == 0 and not body.echo:
            raise BadRequest("max_tokens must be at least 1 (0 only with echo)",
                             param="max_tokens")
        if body.suffix:
            prompts = await asyncio.to_thread(infill_prompts, handle, body.prompt, body.suffix)
        else:
            prompts = await asyncio.to_thread(text_prompts, handle, body.prompt)
        if len(prompts) * body.n > MAX_CHOICES:
            raise BadRequest(f"{len(prompts)} prompts x n={body.n} exceed {MAX_CHOICES} "
                             f"choices", param="prompt")
        ids = [p for p, _ in prompts]
        _check_context(handle, ids, max_tokens or None, "prompt")
        # echo with logprobs: the prompt's too; with max_tokens 0 only the prompt's (the one
        # token the engine must sample is dropped from the answer)
        scored = body.echo and body.logprobs is not None
        params = _sampling(body, max_tokens or (1 if scored else 0), body.logprobs,
                           handle.vocab_size)
        if scored:
            params = replace(params, prompt_logprobs=body.logprobs)
        job = _job("text", handle, principal, ids, params, body.n, None)
        job.logprobs = body.logprobs
        job.is_prompt_only = scored and max_tokens == 0
        job.echo = [text for _, text in prompts] if body.echo else None
        job.include_usage = bool(body.stream and body.stream_options
                                 and body.stream_options.include_usage)
        if max_tokens == 0 and not scored:  # echo only: nothing to generate
            return Response(TEXT.response(_echo_only(job)))
        return await self.generation.run(job, TEXT, receive, body.stream)


_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def chat_prompt(handle: Any, body: Any, offers_tools: bool = True,
                add_generation_prompt: bool = True) -> tuple[tuple[int, ...], str]:
    """The prompt's token ids and its text (body: a chat request, or a /tokenize one)."""
    extra = body.chat_template_kwargs or {}
    if reserved := sorted(_RESERVED & extra.keys()):
        raise BadRequest(f"chat_template_kwargs may not set {', '.join(reserved)}",
                         param="chat_template_kwargs")
    if body.reasoning_effort is not None:  # chat_template_kwargs', when both, wins
        extra = {"reasoning_effort": body.reasoning_effort, **extra}
    tools = body.tools if offers_tools else None
    text = handle.chat_template.render([m.to_dict() for m in body.messages],
                                       add_generation_prompt=add_generation_prompt,
                                       tools=tools, **extra)
    tok = handle.tokenizer
    ids = tok.encode(text, add_special=False, parse_special=True)
    if tok.add_bos and tok.bos_id is not None and ids[:1] != [tok.bos_id]:
        ids.insert(0, tok.bos_id)  # the template did not write BOS; the model wants it
    return tuple(ids), text


def text_prompts(handle: Any, prompt: str | list[Any]) -> list[tuple[tuple[int, ...], str]]:
    """(token ids, text) per prompt: a string, token ids, or a list of either."""
    tok = handle.tokenizer

    def from_text(text: str) -> tuple[tuple[int, ...], str]:
        return tuple(tok.encode(text, add_special=True, parse_special=True)), text

    def from_ids(ids: list[Any]) -> tuple[tuple[int, ...], str]:
        if not all(type(t) is int and 0 <= t < handle.vocab_size for t in ids):
            raise BadRequest(f"prompt token ids must be integers in [0, {handle.vocab_size})",
                             param="prompt")
        return tuple(ids), tok.decode([t for t in ids if t < tok.vocab_size])

    if isinstance(prompt, str):
        return [from_text(prompt)]
    if all(type(p) is int for p in prompt):
        return [from_ids(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [from_text(p) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [from_ids(p) for p in prompt]
    raise BadRequest("prompt must be a string, a list of token ids, or a list of either",
                     param="prompt")


def infill_prompts(handle: Any, prompt: str | list[Any], suffix: str
                   ) -> list[tuple[tuple[int, ...], str]]:
    """Fill-in-the-middle: (token ids, text) per prefix, as llama.cpp's infill builds them:
    [BOS] FIM_PRE prefix FIM_SUF suffix FIM_MID, the texts' specials not parsed."""
    tok = handle.tokenizer
    fim = tok.fim_ids
    if not {"fim_pre", "fim_suf", "fim_mid"} <= fim.keys():
        raise Unsupported("suffix needs a model with fill-in-the-middle tokens; this one has "
                          "none", param="suffix")
    texts = [prompt] if isinstance(prompt, str) else prompt
    if not all(isinstance(t, str) for t in texts):
        raise BadRequest("suffix needs the prompt as text (a string or a list of strings)",
                         param="prompt")
    tail = [fim["fim_suf"], *tok.encode(suffix, add_special=False, parse_special=False),
            fim["fim_mid"]]
    head = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    return [(tuple(head + [fim["fim_pre"]]
                   + tok.encode(t, add_special=False, parse_special=False) + tail), t)
            for t in texts]


def _logit_bias(body: SamplingFields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} as (id, bias) pairs; ids in the vocabulary, biases in
    [-100, 100] (the sampler checks the range)."""
    out: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or not 0 <= int(key) < vocab_size:
            raise BadRequest(f"logit_bias keys must be token ids in [0, {vocab_size}), got "
                             f"{key[:32]!r}", param="logit_bias")
        if type(value) not in (int, float):
            raise BadRequest(f"logit_bias values must be numbers, got {value!r:.32}",
                             param="logit_bias")
        if int(key) in out:
            raise BadRequest(f"logit_bias names token {int(key)} twice", param="logit_bias")
        out[int(key)] = float(value)
    return tuple(out.items())


def _check_context(handle: Any, prompts: list[tuple[int, ...]], max_tokens: int | None,
                   param: str) -> None:
    limit = handle.context
    for ids in prompts:
        want = len(ids) + (max_tokens or 1)
        if want > limit:
            where = "messages" if param == "messages" else "prompt"
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {want} tokens ({len(ids)} in the {where}, {max_tokens or 1} in "
                f"the completion). Please reduce the length of the {where} or completion.",
                code="context_length_exceeded", param=param)


def _sampling(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
              vocab_size: int) -> SamplingParams:
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    params = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0, min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        seed=body.seed, max_tokens=max_tokens or None,
        stop=tuple(s for s in stop if s), stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos, logprobs=logprobs,
        logit_bias=_logit_bias(body, vocab_size))
    validate_params(params)  # InvalidRequest -> 400
    return params


async def _grammar_factory(handle: Any, body: ChatCompletionRequest,
                           forced: str | None, thinking: str) -> Any:
    """None, or a callable making one fresh grammar per choice (the state is per sequence):
    the response_format's, or the forced tool call's (tool_choice.py), either after the
    reasoning a thinking model may write first (`thinking`: replies.thinking_mode)."""
    fmt = body.response_format
    has_format = fmt is not None and fmt.type != "text"
    if forced is not None and has_format:
        raise BadRequest("a required tool call and a response_format cannot both shape the "
                         "reply", param="tool_choice")
    if not has_format and forced is None:
        return None
    from engine.grammar import (
        JsonGrammar,
        grammar_tokenizer,
        json_body,
        json_schema_grammar,
        lark_grammar,
    )

    if forced is not None:
        assert body.tools is not None  # forced_tool refuses a call without tools
        text = forced_call_grammar(handle.chat_template.source, handle.tokenizer, body.tools,
                                   forced, thinking)
    else:
        assert fmt is not None
        schema = None
        if fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise BadRequest("response_format json_schema needs json_schema.schema",
                                 param="response_format")
            schema = fmt.json_schema.schema
        text = json_schema_grammar(schema) if thinking == "none" else \
            lark_grammar(json_body(schema), "", thinking)
    gtok = await asyncio.to_thread(grammar_tokenizer, handle.tokenizer)
    await asyncio.to_thread(JsonGrammar, gtok, text)  # validates the schema once

    def make() -> JsonGrammar:
        return JsonGrammar(gtok, text)
    return make


def _job(kind: str, handle: Any, principal: Principal, prompts: list[tuple[int, ...]],
         params: SamplingParams, n: int, grammar: Any) -> Job:
    job_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    choices = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            seed = None if params.seed is None else params.seed + i
            sampling = replace(params, seed=seed,
                               grammar=grammar() if grammar is not None else None)
            request = Request(f"{job_id}-{index}", ids, sampling, client_id=principal.key_id)
            choices.append(Choice(index, p, request))
    out = params.max_tokens or DEFAULT_ESTIMATE
    estimate = sum(len(p) for p in prompts) + out * len(choices)
    return Job(kind, job_id, handle, principal, choices, prompts, estimate)


def _echo_only(job: Job) -> Job:
    for c in job.choices:
        c.finish_reason = "length"
    return job
