"""Two models behind one port: the embedded default model (Gemma 3 270M) and a tiny
synthetic GGUF. `model` routes; unloading one leaves the other's streams alone; the memory
budget decides what may load. The real model's chat answer against llama.cpp, JSON schema
output on the real model."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from server_harness import TINY_SPEC, assert_openai_error, make_settings, start_harness

from appliance.server.router import GIB, engine_options, planned_bytes
from engine.synthetic import write_synthetic_gguf

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "Say hello."}]
GAP = 0.3  # nats: a smaller top-2 gap may flip under llama.cpp's 8-bit activations


@pytest.fixture(scope="module")
def third_gguf(tmp_path_factory, vocab_dir):
    path = tmp_path_factory.mktemp("third") / "third.gguf"
    write_synthetic_gguf(path, TINY_SPEC, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=11)
    return path


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, tiny_gguf, third_gguf):
    data = tmp_path_factory.mktemp("router")
    opts = engine_options(make_settings(data, ["default"], sessions=2, context=512))
    need = {name: planned_bytes(src, opts) for name, src in (
        ("default", "default"), ("tiny", str(tiny_gguf)), ("third", str(third_gguf)))}
    # Room for default + tiny + half of third: third fits only once tiny is gone.
    budget = need["default"] + need["tiny"] + need["third"] // 2
    h = await start_harness(data, ["default", str(tiny_gguf)], sessions=2,
                            context=512, memory_gb=budget / GIB)
    yield h
    await h.close()


async def test_model_routes_by_name(harness):
    client = harness.openai()
    listed = [m.id for m in (await client.models.list()).data]
    assert listed == ["default", "tiny"]
    for asked, served in (("tiny", "tiny"), ("default", "default"), (None, "default")):
        body = {"messages": HI, "max_tokens": 2, **({"model": asked} if asked else {})}
        resp = await harness.http.post("/v1/chat/completions", json=body, headers=harness.auth())
        assert resp.status_code == 200 and resp.json()["model"] == served


def _llama_cpp_confident_greedy(path, prompt: list[int], max_tokens: int) -> list[int]:
    """llama.cpp's greedy tokens after `prompt`, up to the first step whose top-2 logit gap
    is under GAP (where quantized-activation rounding may flip the choice)."""
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False,
                          n_threads=2)
    tokens: list[int] = []
    llm.eval(prompt)
    for _ in range(max_tokens):
        logits = np.asarray(llm.scores[llm.n_tokens - 1])
        top2 = np.sort(logits)[-2:]
        if top2[1] - top2[0] < GAP:
            break
        tokens.append(int(logits.argmax()))
        llm.eval([tokens[-1]])
    return tokens


async def test_default_model_matches_llama_cpp(harness):
    import llama_cpp

    handle = harness.state.router.get("default")
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    text = handle.chat_template.render(messages, add_generation_prompt=True)
    prompt = handle.tokenizer.encode(text, add_special=False, parse_special=True)
    ref = llama_cpp.Llama(model_path=str(handle.engine.loaded.path), vocab_only=True,
                          verbose=False)
    assert prompt == ref.tokenize(text.encode(), add_bos=False, special=True)
    expected = _llama_cpp_confident_greedy(handle.engine.loaded.path, prompt, 12)
    assert len(expected) >= 3
    resp = await harness.openai().chat.completions.create(
        model="default", messages=messages, temperature=0, max_tokens=12)
    assert resp.usage.prompt_tokens == len(prompt)
    want = ref.detokenize(expected).decode("utf-8", "replace").lstrip(" ")
    assert resp.choices[0].message.content.lstrip(" ").startswith(want)


async def test_default_model_json_schema(harness):
    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 12}}}
    resp = await harness.openai().chat.completions.create(
        model="default", temperature=0, max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        messages=[{"role": "user", "content": "The capital of France, as JSON."}])
    assert resp.choices[0].finish_reason == "stop"
    value = json.loads(resp.choices[0].message.content)
    assert list(value) == ["city"] and len(value["city"]) <= 12


async def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


def _decoding(harness, name: str) -> bool:
    stats = harness.state.router.get(name).engine.stats()
    return stats is not None and any(s.phase == "decode" for s in stats.sessions)


async def test_unload_leaves_other_streams_alone_and_budget_decides(harness, third_gguf):
    admin = harness.auth()
    stream_body = {"model": "default", "messages": HI, "max_tokens": 24, "ignore_eos": True,
                   "stream": True, "temperature": 0}
    default_stream = asyncio.create_task(harness.http.post(
        "/v1/chat/completions", json=stream_body, headers=admin))
    tiny_request = asyncio.create_task(harness.http.post("/v1/chat/completions", headers=admin,
                                                         json={"model": "tiny", "messages": HI,
                                                               "max_tokens": 400,
                                                               "ignore_eos": True}))
    await _until(lambda: _decoding(harness, "default") and _decoding(harness, "tiny"))
    refused = await harness.http.post("/admin/api/models/load", headers=admin,
                                      json={"name": str(third_gguf)})
    err = assert_openai_error(refused, 409, "insufficient_memory")
    assert "GiB" in err["message"] and "budget" in err["message"]
    resp = await harness.http.post("/admin/api/models/unload", json={"name": "tiny"},
                                   headers=admin)
    assert resp.status_code == 200
    assert_openai_error(await tiny_request, 503, "model_unloaded")
    streamed = await default_stream
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    resp = await harness.http.post("/v1/chat/completions", headers=admin,
                                   json={"model": "tiny", "messages": HI})
    assert_openai_error(resp, 404, "model_not_found")
    loaded = await harness.http.post("/admin/api/models/load", headers=admin,
                                     json={"name": str(third_gguf)})
    assert loaded.status_code == 200 and loaded.json()["name"] == "third"
    state = (await harness.http.get("/admin/api/models", headers=admin)).json()
    assert [m["name"] for m in state["loaded"]] == ["default", "third"]
    assert state["memory"]["used_bytes"] <= state["memory"]["budget_bytes"]
