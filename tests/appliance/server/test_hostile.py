"""Malformed and hostile request bodies: every one gets a 4xx with an OpenAI error body
(never a 500), and the server keeps serving: /health and a normal stream afterwards."""

from __future__ import annotations

import json

import pytest
from server_harness import asgi_request, assert_openai_error, start_harness

pytestmark = pytest.mark.anyio

MSG = [{"role": "user", "content": "hi"}]
MAX_BODY = 1 << 20


def _chat(**fields) -> bytes:
    return json.dumps({"messages": MSG, "max_tokens": 2, **fields}).encode()


def _nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


CHAT_BODIES: list[bytes] = [
    b"", b" ", b"{", b"}", b"null", b"[]", b"42", b'"text"', b"true", b"{]", b'{"messages":',
    b"\xff\xfe\xfd", b'{"messages": "\xc3\x28"}', b'{"messages": [{"role": "user", "content": '
    b'"\xed\xa0\x80"}]}', b'{"a": NaN}', b'{"a": Infinity}', b"{'single': 'quotes'}",
    b'{"messages": []}', b'{"messages": {}}', b'{"messages": [1, 2]}', b'{"messages": [null]}',
    b'{"messages": [{"content": "no role"}]}', b'{"messages": [{"role": "", "content": "x"}]}',
    b'{"messages": [{"role": 5, "content": "x"}]}', _nested(10_000).encode(),
    ('{"messages": ' + _nested(10_000) + "}").encode(),
    ('{"a":' * 10_000 + "1" + "}" * 10_000).encode(),
    ('{"messages": [{"role": "user", "content": "x", "tool_calls": [' + _nested(900, "{}")
     + "]}]}").encode(),
    _chat(temperature=1e999), _chat(max_tokens=10 ** 400), _chat(max_tokens=-(10 ** 400)),
    _chat(seed=10 ** 30), _chat(top_k=10 ** 20), _chat(n=0), _chat(n=1000), _chat(max_tokens=-1),
    _chat(max_tokens="5"), _chat(temperature="hot"), _chat(temperature=-0.5), _chat(top_p=0),
    _chat(top_p=1.5), _chat(min_p=2), _chat(presence_penalty=3), _chat(frequency_penalty=-9),
    _chat(repetition_penalty=0), _chat(top_logprobs=50, logprobs=True), _chat(top_logprobs=2),
    _chat(stop=[1, 2]), _chat(stop=["x"] * 100), _chat(stop="y" * 5000), _chat(stream="yes"),
    _chat(stream_options=[]), _chat(response_format={"type": "xml"}),
    _chat(response_format={"type": "json_schema"}),
    _chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 7}}}),
    _chat(logit_bias={"1": 1000}), _chat(logit_bias={"1e3": 1}),
    _chat(logit_bias={"1": [1]}), _chat(model="x" * 300), _chat(model="../../etc/passwd"),
    _chat(model=["tiny"]), _chat(messages=[{"role": "user", "content": [{"type": "image_url",
                                                                          "image_url": "x"}]}]),
    _chat(messages=[{"role": "user", "content": 12}]),
    _chat(messages=[{"role": "user"}]), _chat(messages=[{"role": "system", "content": None}]),
    _chat(messages=[{"role": "assistant", "content": "a"}, {"role": "tool"}]),
    _chat(chat_template_kwargs={"messages": "override"}),
    _chat(chat_template_kwargs={"x": object.__name__, "deep": json.loads(_nested(40, "{}"))}),
    _chat(messages=[{"role": "user", "content": "word " * 2000}], max_tokens=10),
    _chat(stop_token_ids=[-1]), _chat(max_completion_tokens=0),
]
TEXT_BODIES: list[bytes] = [
    b'{"prompt": null}', b'{"prompt": []}', b'{"prompt": [1, "a"]}', b'{"prompt": [[1], "a"]}',
    b'{"prompt": [-1]}', b'{"prompt": [99999999]}', b'{"prompt": [1.5]}', b'{"prompt": [true]}',
    b'{"prompt": {"a": 1}}', b'{"prompt": "x", "echo": true, "logprobs": 21}',
    b'{"prompt": "x", "suffix": "y"}', b'{"prompt": "x", "best_of": 3}',
    b'{"prompt": "x", "logprobs": 99}', b'{"prompt": "x", "max_tokens": 0}',
    b'{"prompt": ["a", "b", "c", "d", "e"], "n": 16}',
]
OTHER_BODIES: list[tuple[str, bytes]] = [  # the endpoints beside the completions
    ("/v1/embeddings", b'{"input": null}'), ("/v1/embeddings", b'{"input": [[1], "a"]}'),
    ("/v1/embeddings", b'{"input": "x", "dimensions": 0}'),
    ("/v1/embeddings", ('{"input": ' + _nested(5_000) + "}").encode()),
    ("/tokenize", b'{}'), ("/tokenize", b'{"prompt": "a", "messages": []}'),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "x"}], "tools": 5}'),
    ("/detokenize", b'{"tokens": [99999999]}'), ("/detokenize", b'{"tokens": "abc"}'),
    ("/v1/chat/completions", _chat(tool_choice="maybe", tools=[])),
    ("/v1/chat/completions", _chat(tool_choice={"type": "function"})),
    ("/v1/chat/completions", _chat(tools=[{"type": "function", "function": {"name": "a b"}}],
                                   tool_choice="required")),
    ("/v1/chat/completions", _chat(reasoning_effort="extreme")),
    ("/v1/chat/completions", _chat(reasoning_format="xml")),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"1": "high"}}'),
]
ADMIN_BODIES: list[tuple[str, bytes]] = [
    ("/admin/api/models/load", b'{"name": ""}'), ("/admin/api/models/load", b'{"name": 5}'),
    ("/admin/api/models/load", b'{"name": "/etc/passwd"}'),
    ("/admin/api/models/load", b'{"name": "x", "sessions": 0}'),
    ("/admin/api/models/load", b'{"name": "x", "kv_quant": "q2"}'),
    ("/admin/api/models/unload", b'{"name": "missing"}'), ("/admin/api/keys", b'{"name": "x"}'),
    ("/admin/api/keys", b'{"name": "x", "user": "y", "role": "root"}'),
    ("/admin/api/keys", b'{"name": "x", "user": "y", "quota": {"max_pending": 0}}'),
    ("/admin/api/keys", b'{"name": "x", "user": "y", "quota": {"expires_at": "soon"}}'),
    ("/admin/api/keys", b'{"name": "x", "user": "y", "quota": {"expires_at": "2030-01-01"}}'),
    ("/admin/api/models", b'{"path": "/nonexistent.gguf"}'),
    ("/admin/api/models", b'{"path": "/etc/hostname"}'),
]


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, tiny_gguf):
    h = await start_harness(tmp_path_factory.mktemp("hostile"), [str(tiny_gguf)],
                            max_body_bytes=MAX_BODY)
    yield h
    await h.close()


async def _send(harness, path: str, body: bytes, status_range=(400, 499)) -> None:
    headers = {"Authorization": f"Bearer {harness.admin_key}".encode(),
               "Content-Type": b"application/json"}
    resp = await asgi_request(harness.app, "POST", path, headers=headers, body=body)
    assert status_range[0] <= resp.status <= status_range[1], (path, body[:80], resp.status,
                                                               resp.body[:300])
    assert_openai_error(resp, resp.status)


async def test_hostile_bodies_get_4xx_and_the_server_keeps_serving(harness):
    cases = [("/v1/chat/completions", b) for b in CHAT_BODIES]
    cases += [("/v1/completions", b) for b in TEXT_BODIES + CHAT_BODIES[:12]]
    cases += ADMIN_BODIES + OTHER_BODIES
    cases.append(("/v1/chat/completions", _chat(messages=[{"role": "user",
                                                            "content": "x" * MAX_BODY}])))
    assert len(cases) >= 60
    for path, body in cases:
        await _send(harness, path, body)
    health = await harness.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    client = harness.openai()
    stream = await client.chat.completions.create(model="tiny", messages=MSG, max_tokens=4,
                                                  stream=True)
    chunks = [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices[0].delta.content) >= 1
    stats = harness.state.router.get(None).engine.stats()
    assert not stats.sessions and stats.num_waiting == 0


async def test_hostile_headers(harness):
    for headers in ({"Authorization": b"Bearer \xff\xfe"}, {"Authorization": b"\x00" * 100},
                    {"Content-Length": b"-5"}, {"Content-Length": b"abc"},
                    {"Authorization": b"Bearer " + b"a" * 100_000}):
        resp = await asgi_request(harness.app, "POST", "/v1/chat/completions",
                                  headers=headers, body=_chat())
        assert 400 <= resp.status < 500, (headers, resp.status, resp.body[:200])
        assert_openai_error(resp, resp.status)
