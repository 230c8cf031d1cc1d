"""Per-key enforcement: the scheduler's pending limit (429 client_quota), the concurrent
request cap, rate limits with Retry-After, and fair treatment of the other keys."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_harness import assert_openai_error, start_harness

pytestmark = pytest.mark.anyio
LONG = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 400, "ignore_eos": True}
SHORT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, tiny_gguf):
    h = await start_harness(tmp_path_factory.mktemp("quota"), [str(tiny_gguf)], sessions=1,
                            context=512)
    yield h
    await h.close()


async def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.005)


def _stats(harness):
    return harness.state.router.get(None).engine.stats()


def _running(harness, key_id: str) -> bool:
    stats = _stats(harness)
    return stats is not None and any(s.client_id == key_id and s.phase == "decode"
                                     for s in stats.sessions)


def _waiting(harness, key_id: str) -> int:
    stats = _stats(harness)
    return 0 if stats is None else sum(c.num_waiting for c in stats.clients
                                       if c.client_id == key_id)


async def _post(harness, key: str, body: dict):
    return await harness.http.post("/v1/chat/completions", json=body, headers=harness.auth(key))


async def test_pending_limit_gives_429_client_quota(harness):
    key, key_id = await harness.create_key("q", "quinn", max_pending=1)
    other, other_id = await harness.create_key("o", "olga")
    first = asyncio.create_task(_post(harness, key, LONG))
    await _until(lambda: _running(harness, key_id))
    second = asyncio.create_task(_post(harness, key, LONG))
    await _until(lambda: _waiting(harness, key_id) == 1)
    resp = await _post(harness, key, SHORT)
    err = assert_openai_error(resp, 429, "client_quota")
    assert "pending" in err["message"] or "quota" in err["message"]
    assert int(resp.headers["retry-after"]) >= 1
    third = asyncio.create_task(_post(harness, other, SHORT))  # another key still queues
    await _until(lambda: _waiting(harness, other_id) == 1)
    first.cancel()
    second.cancel()
    resp = await third
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
    await asyncio.gather(first, second, return_exceptions=True)
    await _until(lambda: not _stats(harness).sessions)


async def test_concurrent_request_cap(harness):
    key, key_id = await harness.create_key("c", "cleo", max_concurrent_streams=1)
    first = asyncio.create_task(_post(harness, key, LONG))
    await _until(lambda: _running(harness, key_id))
    resp = await _post(harness, key, SHORT)
    assert_openai_error(resp, 429, "concurrent_streams")
    assert "retry-after" in resp.headers
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await _until(lambda: not _stats(harness).sessions)
    resp = await _post(harness, key, SHORT)  # the slot was released
    assert resp.status_code == 200, resp.text


async def test_rate_limit_with_retry_after(harness):
    key, _ = await harness.create_key("r", "rita", requests_per_min=2)
    for _ in range(2):
        assert (await _post(harness, key, SHORT)).status_code == 200
    resp = await _post(harness, key, SHORT)
    err = assert_openai_error(resp, 429)
    assert "requests_per_min" in err["message"]
    assert 1 <= int(resp.headers["retry-after"]) <= 60


async def test_token_limit_counts_the_estimate(harness):
    key, _ = await harness.create_key("t", "tom", tokens_per_min=50)
    resp = await _post(harness, key, {**SHORT, "max_tokens": 100})
    err = assert_openai_error(resp, 429)
    assert "tokens_per_min" in err["message"]


async def test_model_not_allowed(harness):
    key, _ = await harness.create_key("m", "mia", allowed_models=["other-model"])
    resp = await _post(harness, key, {**SHORT, "model": "tiny"})
    assert_openai_error(resp, 403, "model_not_allowed")
    resp = await _post(harness, key, SHORT)  # the default model resolves to 'tiny': also 403
    assert_openai_error(resp, 403, "model_not_allowed")
