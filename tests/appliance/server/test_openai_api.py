"""The OpenAI-compatible endpoints through the official `openai` client, in-process.

Outputs are checked against independent paths: streamed text against the non-streamed
answer, choice i of an n-request against a single request with seed + i, logprobs
against float64 log-softmax of teacher-forced logits from engine.llm.LLM (a separate,
one-sequence path), token counts against the tokenizer, JSON output with json.loads.
"""

from __future__ import annotations

import json
import logging

import openai
import pytest
import torch
from server_harness import assert_openai_error, start_harness

from engine.llm import LLM

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, tiny_gguf):
    h = await start_harness(tmp_path_factory.mktemp("api"), [str(tiny_gguf)], dtype="f32")
    yield h
    await h.close()


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    return LLM(tiny_gguf, dtype="f32", context=256)


def _prompt_ids(harness, messages) -> list[int]:
    handle = harness.state.router.get(None)
    text = handle.chat_template.render(messages, add_generation_prompt=True)
    return handle.tokenizer.encode(text, add_special=False, parse_special=True)


async def test_chat_stream_matches_whole_answers(harness):
    client = harness.openai()
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.9, seed=5)
    stream = await client.chat.completions.create(
        **kwargs, n=2, stream=True, stream_options={"include_usage": True})
    texts, finish, usage, roles = ["", ""], [None, None], None, set()
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles.add((c.index, c.delta.role))
            finish[c.index] = c.finish_reason or finish[c.index]
    assert (0, "assistant") in roles and (1, "assistant") in roles
    assert finish == ["length", "length"]
    prompt = _prompt_ids(harness, MESSAGES)
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 24
    assert usage.total_tokens == len(prompt) + 24
    assert usage.prompt_tokens_details.cached_tokens >= 0
    first = await client.chat.completions.create(**kwargs)
    second = await client.chat.completions.create(**{**kwargs, "seed": 6})
    assert texts == [first.choices[0].message.content, second.choices[0].message.content]
    assert first.choices[0].message.role == "assistant"
    assert first.usage.completion_tokens == 12 and first.choices[0].finish_reason == "length"


async def test_logprobs_match_teacher_forced_reference(harness, reference):
    client = harness.openai()
    resp = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6,
                                                temperature=0, logprobs=True, top_logprobs=3)
    content = resp.choices[0].logprobs.content
    assert len(content) == 6
    prompt = _prompt_ids(harness, MESSAGES)
    pieces = harness.state.router.get(None).tokenizer.pieces()
    ids = [next(i for i, p in enumerate(pieces) if list(p) == c.bytes) for c in content]
    logits = reference.prompt_logits(prompt + ids[:-1])[len(prompt) - 1:]  # (6, vocab)
    logp = torch.log_softmax(logits.double(), dim=-1)
    for row, entry, token_id in zip(logp, content, ids, strict=True):
        assert entry.logprob == pytest.approx(float(row[token_id]), abs=2e-3)
        top = torch.topk(row, 3)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(),
                                                                        abs=2e-3)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the top token
    assert ids[0] == int(logp[0].argmax())


async def test_stop_string_ends_the_answer_before_it(harness):
    client = harness.openai()
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0)
    full = (await client.chat.completions.create(**kwargs)).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop) == 3
    resp = await client.chat.completions.create(**kwargs, stop=[stop])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content == full[:full.index(stop)]


async def test_text_completions(harness):
    client = harness.openai()
    tok = harness.state.router.get(None).tokenizer
    ids = tok.encode("Once upon a time", add_special=True)
    by_text = await client.completions.create(model="tiny", prompt="Once upon a time",
                                              max_tokens=5, temperature=0, echo=True)
    assert by_text.choices[0].text.startswith("Once upon a time")
    assert by_text.usage.prompt_tokens == len(ids)
    by_ids = await client.completions.create(model="tiny", prompt=ids, max_tokens=5,
                                             temperature=0, logprobs=2)
    assert by_text.choices[0].text == "Once upon a time" + by_ids.choices[0].text
    lp = by_ids.choices[0].logprobs
    assert len(lp.tokens) == 5 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens).lstrip(" ") == by_ids.choices[0].text.lstrip(" ")
    batch = await client.completions.create(model="tiny", prompt=["a b", "c d e"], n=2,
                                            max_tokens=3)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    assert batch.usage.prompt_tokens == len(tok.encode("a b")) + len(tok.encode("c d e"))
    assert batch.usage.completion_tokens == 12
    stream = await client.completions.create(model="tiny", prompt=ids, max_tokens=5,
                                             temperature=0, stream=True)
    assert "".join([c.choices[0].text async for c in stream]) == by_ids.choices[0].text
    default = await client.completions.create(model="tiny", prompt="x",
                                              extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens


async def test_echo_logprobs_score_the_prompt(harness, reference):
    """echo + logprobs (how evaluation harnesses score a text): every prompt token's logprob
    given the ones before it, against float64 log-softmax of the teacher-forced logits;
    max_tokens 0 scores the prompt alone. The server's prefill chunk (64) is shorter than
    the prompt, and the prompt is in the prefix cache from the first request."""
    client = harness.openai()
    tok = harness.state.router.get(None).tokenizer
    text = "The quick brown fox jumps over the lazy dog. " * 8
    ids = tok.encode(text, add_special=True, parse_special=True)
    assert len(ids) > 64
    logp = torch.log_softmax(reference.prompt_logits(ids).double(), dim=-1)  # (n, vocab)
    await client.completions.create(model="tiny", prompt=text, max_tokens=2)  # cache it
    for max_tokens, stream in ((0, False), (2, False), (2, True)):
        kwargs = dict(model="tiny", prompt=text, max_tokens=max_tokens, temperature=0,
                      echo=True, logprobs=3)
        if stream:
            chunks = [c async for c in await client.completions.create(**kwargs, stream=True)]
            lp, out = chunks[0].choices[0].logprobs, "".join(c.choices[0].text for c in chunks)
        else:
            resp = await client.completions.create(**kwargs)
            lp, out = resp.choices[0].logprobs, resp.choices[0].text
            assert resp.usage.completion_tokens == max_tokens
        assert out.startswith(text) and (max_tokens or out == text)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p in range(1, len(ids)):
            assert lp.token_logprobs[p] == pytest.approx(float(logp[p - 1, ids[p]]), abs=2e-3)
            assert len(lp.top_logprobs[p]) <= 3
            best = max(lp.top_logprobs[p].values())
            assert best == pytest.approx(float(logp[p - 1].max()), abs=2e-3)
        assert len(lp.tokens) == len(ids) + (max_tokens if not stream else 1)


async def test_tokenize_and_detokenize(harness):
    """/tokenize counts what a request would send: a text as /v1/completions encodes it, messages
    as the chat endpoint renders them (its usage.prompt_tokens); /detokenize inverts it."""
    client, tok = harness.openai(), harness.state.router.get(None).tokenizer
    text = "Hello <s> world"
    resp = await harness.http.post("/tokenize", headers=harness.auth(), json={"prompt": text})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["tokens"] == tok.encode(text, add_special=True, parse_special=True)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 256
    resp = await harness.http.post("/tokenize", headers=harness.auth(), json={
        "prompt": text, "add_special_tokens": False})
    assert resp.json()["tokens"] == tok.encode(text, add_special=False, parse_special=True)
    chat = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1)
    resp = await harness.http.post("/tokenize", headers=harness.auth(),
                                   json={"messages": MESSAGES, "model": "tiny"})
    assert resp.json()["tokens"] == _prompt_ids(harness, MESSAGES)
    assert resp.json()["count"] == chat.usage.prompt_tokens
    resp = await harness.http.post("/detokenize", headers=harness.auth(),
                                   json={"tokens": body["tokens"]})
    assert resp.json() == {"prompt": tok.decode(body["tokens"])}
    for path, bad in (("/tokenize", {}), ("/tokenize", {"prompt": "a", "messages": MESSAGES}),
                      ("/detokenize", {"tokens": [tok.vocab_size]}),
                      ("/detokenize", {"tokens": [-1]}), ("/tokenize", {"prompt": 5})):
        resp = await harness.http.post(path, headers=harness.auth(), json=bad)
        assert_openai_error(resp, 400)
    resp = await harness.http.post("/tokenize", json={"prompt": "a"})
    assert_openai_error(resp, 401)


async def test_extensions_top_k_min_p_are_applied(harness):
    client = harness.openai()
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8)
    greedy = (await client.chat.completions.create(**kwargs, temperature=0)).choices[0]
    for extra in ({"top_k": 1}, {"min_p": 1.0}):  # both leave only the most likely token
        hot = await client.chat.completions.create(**kwargs, temperature=1.5, seed=9,
                                                   extra_body={**extra, "ignore_eos": True,
                                                               "repetition_penalty": 1.0})
        assert hot.choices[0].message.content == greedy.message.content
    hot = await client.chat.completions.create(**kwargs, temperature=1.5, seed=9)
    assert hot.choices[0].message.content != greedy.message.content


async def test_continuation_keeps_the_first_tokens_space(harness):
    client = harness.openai()
    ids = harness.state.router.get(None).tokenizer.encode("Once upon a time", add_special=True)
    resp = await client.completions.create(model="tiny", prompt=ids, max_tokens=5,
                                           temperature=0, logprobs=0)
    assert resp.choices[0].text == "".join(resp.choices[0].logprobs.tokens)


async def test_json_modes_give_parseable_json(harness):
    client = harness.openai()
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
              "properties": {"name": {"type": "string", "maxLength": 6},
                             "ok": {"type": "boolean"}}}
    resp = await client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=60, temperature=0.8, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    value = json.loads(resp.choices[0].message.content)
    assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool)
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    resp = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                                temperature=0.7, n=2, seed=3,
                                                response_format={"type": "json_object"})
    for choice in resp.choices:  # random weights may write one endless string: a prefix
        assert choice.message.content.lstrip().startswith("{")
    bad = await harness.http.post("/v1/chat/completions", headers=harness.auth(), json={
        "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "no-such-type"}}}})
    assert_openai_error(bad, 400)


async def test_models_health_metrics_headers(harness):
    client = harness.openai()
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert (await client.models.retrieve("tiny")).id == "tiny"
    health = await harness.http.get("/health")
    assert health.status_code == 200 and health.json() == {"status": "ok", "models": ["tiny"]}
    for header, value in (("x-content-type-options", "nosniff"), ("x-frame-options", "DENY"),
                          ("referrer-policy", "no-referrer")):
        assert health.headers[header] == value
    assert "frame-ancestors 'none'" in health.headers["content-security-policy"]
    assert "access-control-allow-origin" not in health.headers
    await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    text = (await harness.http.get("/metrics")).text
    key_id = harness.admin_key.split("_")[1]
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "request_queue_time_seconds", "e2e_request_latency_seconds"):
        assert f'mbufo:{name}_count{{key="{key_id}",model="tiny"}}' in text
    for name in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        assert f'mbufo:{name}{{model="tiny"}}' in text
    for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens",
                 "generation_tokens"):
        assert f'mbufo:{name}_total{{key="{key_id}",model="tiny"}}' in text
    assert harness.admin_key.split("_")[2] not in text


async def test_errors_are_openai_shaped(harness):
    client = harness.openai()
    with pytest.raises(openai.NotFoundError) as exc:
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    assert exc.value.body["code"] == "model_not_found"
    long = [{"role": "user", "content": "word " * 300}]
    with pytest.raises(openai.BadRequestError) as exc:
        await client.chat.completions.create(model="tiny", messages=long, max_tokens=10)
    err = exc.value.body
    n = len(_prompt_ids(harness, long))
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "256" in err["message"] and f"{n + 10} tokens ({n} in the messages" in err["message"]
    for extra in ({"temperature": -1}, {"top_p": 0}, {"n": 0}, {"max_tokens": -1},
                  {"top_logprobs": 3}, {"logit_bias": {"5": 101}},
                  {"logit_bias": {"-5": 1}}, {"logit_bias": {"x": 1}},
                  {"logit_bias": {"5": "1"}}, {"logit_bias": {"5": 1, "05": 2}},
                  {"logit_bias": {str(harness.state.router.get(None).vocab_size): 1}}):
        resp = await harness.http.post("/v1/chat/completions", headers=harness.auth(),
                                       json={"messages": MESSAGES, **extra})
        assert_openai_error(resp, 400)
    for path, what in (("/v1/embeddings", "embeddings"), ("/v1/rerank", "reranking")):
        resp = await harness.http.post(path, headers=harness.auth(),
                                       json={"model": "tiny", "input": "x", "query": "q"})
        err = assert_openai_error(resp, 400, "model_not_supported")
        assert what in err["message"]
    resp = await harness.http.get("/v1/chat/completions", headers=harness.auth())
    assert_openai_error(resp, 405)
    resp = await harness.http.post("/v1/completions", headers=harness.auth(),
                                   content=b" " * (harness.state.settings.max_body_bytes + 1))
    assert_openai_error(resp, 413)


async def test_logit_bias_forces_and_bans_tokens(harness):
    client = harness.openai()
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0.8, seed=3,
                  logprobs=True)
    forced = await client.chat.completions.create(**kwargs, logit_bias={"450": 100})
    pieces = harness.state.router.get(None).tokenizer.pieces()
    assert [c.bytes for c in forced.choices[0].logprobs.content] == [list(pieces[450])] * 6
    plain = await client.chat.completions.create(**{**kwargs, "temperature": 0})
    first = plain.choices[0].logprobs.content[0].bytes
    banned_id = next(i for i, p in enumerate(pieces) if list(p) == first)
    banned = await client.chat.completions.create(**{**kwargs, "temperature": 0},
                                                  logit_bias={str(banned_id): -100})
    assert banned.choices[0].logprobs.content[0].bytes != first
    text = await client.completions.create(model="tiny", prompt="Hello", max_tokens=3,
                                           logit_bias={"450": 100}, temperature=1.0)
    assert text.choices[0].text == pieces[450].decode() * 3


async def test_unknown_fields_are_ignored_and_logged(harness, caplog):
    caplog.set_level(logging.INFO, logger="appliance.server.schemas")
    resp = await harness.http.post("/v1/chat/completions", headers=harness.auth(), json={
        "messages": MESSAGES, "max_tokens": 2, "frobnicate": 1, "metadata": {"a": 1}})
    assert resp.status_code == 200, resp.text
    assert "'frobnicate'" in caplog.text and "'metadata'" in caplog.text


async def test_usage_is_recorded_per_key(harness):
    key, key_id = await harness.create_key("usage", "frank")
    client = harness.openai(key)
    resp = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    harness.state.limiter.flush()
    got = await harness.http.get(f"/admin/api/usage?key_id={key_id}", headers=harness.auth())
    rows = got.json()["data"]
    assert len(rows) == 1 and rows[0]["model"] == "tiny"
    assert rows[0]["prompt_tokens"] == resp.usage.prompt_tokens
    assert rows[0]["completion_tokens"] == resp.usage.completion_tokens == 4


async def test_repeated_prompt_reports_cached_tokens(harness):
    client = harness.openai()
    messages = [{"role": "user", "content": "A long enough prompt to fill pages. " * 6}]
    first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    again = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    cached = again.usage.prompt_tokens_details.cached_tokens
    prompt = again.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert cached % 16 == 0 and prompt - 16 <= cached < prompt  # whole pages, not the last
