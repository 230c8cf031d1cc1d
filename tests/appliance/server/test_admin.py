"""The admin API's model registry and live engine state; CORS; 503 answers."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_harness import assert_openai_error, start_harness

pytestmark = pytest.mark.anyio
LONG = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 300, "ignore_eos": True}
ORIGIN = "https://dash.example"


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, tiny_gguf):
    h = await start_harness(tmp_path_factory.mktemp("admin"), [str(tiny_gguf)], sessions=1,
                            context=512, cors_origins=[ORIGIN])
    yield h
    await h.close()


async def test_registry_add_load_by_name_unload_remove(harness, tiny_gguf):
    admin = harness.auth()
    resp = await harness.http.post("/admin/api/models", headers=admin, json={
        "path": str(tiny_gguf), "name": "tiny-reg", "sessions": 2, "context": 128})
    assert resp.status_code == 201, resp.text
    assert resp.json()["architecture"] == "llama" and len(resp.json()["sha256"]) == 64
    listing = (await harness.http.get("/admin/api/models", headers=admin)).json()
    assert [m["name"] for m in listing["registered"]] == ["tiny-reg"]
    assert [m["name"] for m in listing["loaded"]] == ["tiny"] and listing["default"] == "tiny"
    load = asyncio.create_task(harness.http.post("/admin/api/models/load", headers=admin,
                                                 json={"name": "tiny-reg"}))
    deadline = time.monotonic() + 10
    while not harness.state.router.loading():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.001)
    chat = await harness.http.post("/v1/chat/completions", headers=admin, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert chat.status_code == 200 and not load.done()  # served while the load ran
    resp = await load
    assert resp.status_code == 200, resp.text
    assert (resp.json()["sessions"], resp.json()["context"]) == (2, 128)  # registry defaults
    chat = await harness.http.post("/v1/chat/completions", headers=admin, json={
        "model": "tiny-reg", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert chat.json()["model"] == "tiny-reg"
    assert (await harness.http.post("/admin/api/models/unload", headers=admin,
                                    json={"name": "tiny-reg"})).status_code == 200
    assert (await harness.http.post("/admin/api/models/remove", headers=admin,
                                    json={"name": "tiny-reg"})).status_code == 200
    resp = await harness.http.post("/admin/api/models/remove", headers=admin,
                                   json={"name": "tiny-reg"})
    assert_openai_error(resp, 404)


async def test_live_state_shows_sessions_pages_and_queues(harness):
    key, key_id = await harness.create_key("s", "sam", max_pending=4)
    tasks = [asyncio.create_task(harness.http.post("/v1/chat/completions", json=LONG,
                                                   headers=harness.auth(key)))
             for _ in range(2)]
    deadline = time.monotonic() + 20
    while True:
        state = (await harness.http.get("/admin/api/state", headers=harness.auth())).json()
        model = state["models"][0]
        phases = {s["phase"] for s in model["sessions"]}
        if "decode" in phases and model["clients"]:
            break
        assert time.monotonic() < deadline, model
        await asyncio.sleep(0.01)
    running = next(s for s in model["sessions"] if s["phase"] == "decode")
    assert running["client_id"] == key_id and running["prompt_tokens"] > 0
    assert running["generated_tokens"] >= 1 and running["ttft_ms"] > 0
    assert model["clients"] == [{"client_id": key_id, "num_waiting": 1,
                                 "oldest_wait_s": model["clients"][0]["oldest_wait_s"]}]
    assert model["clients"][0]["oldest_wait_s"] > 0
    (kv,) = model["kv"]
    assert kv["group"] == "full" and kv["format"] == "f16"
    assert kv["num_used"] + kv["num_free"] == kv["num_pages"] and kv["num_used"] > 0
    assert model["num_steps"] > 0 and model["recent_itl_ms"]
    assert isinstance(model["slow_steps"], list)  # the steps over the ITL target, if any
    assert model["graphs"] >= 0 and model["graphs_pending"] >= 0  # none on the CPU path
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_overloaded_and_draining_answer_503(harness):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    router, generation = harness.state.router, harness.state.generation
    router.max_in_flight = 0
    try:
        resp = await harness.http.post("/v1/chat/completions", json=body, headers=harness.auth())
        assert_openai_error(resp, 503, "overloaded")
        assert resp.headers["retry-after"] == "1"
    finally:
        router.max_in_flight = 512
    generation.is_draining = True
    try:
        resp = await harness.http.post("/v1/chat/completions", json=body, headers=harness.auth())
        assert_openai_error(resp, 503, "shutting_down")
        assert (await harness.http.get("/health")).status_code == 503
    finally:
        generation.is_draining = False
    assert (await harness.http.post("/v1/chat/completions", json=body,
                                    headers=harness.auth())).status_code == 200


async def test_cors_only_for_configured_origins(harness):
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    ok = await harness.http.options("/v1/chat/completions",
                                    headers={"Origin": ORIGIN, **preflight})
    assert ok.headers.get("access-control-allow-origin") == ORIGIN
    other = await harness.http.options("/v1/chat/completions",
                                       headers={"Origin": "https://evil.example", **preflight})
    assert other.headers.get("access-control-allow-origin") not in ("*", "https://evil.example")
    resp = await harness.http.get("/health", headers={"Origin": ORIGIN})
    assert resp.headers.get("access-control-allow-origin") == ORIGIN


def test_slow_steps_newest_first_with_their_age():
    from appliance.server.services.admin import slow_steps
    from engine.scheduler.plan import SlowStep

    steps = (SlowStep(10.0, 150.0, 60.0, 4, 0, "capture"),
             SlowStep(12.5, 80.0, 60.0, 3, 256, "eager"))
    assert slow_steps(steps, 13.0) == [
        {"ms": 80.0, "target_ms": 60.0, "decode_rows": 3, "prefill_tokens": 256,
         "path": "eager", "age_s": 0.5},
        {"ms": 150.0, "target_ms": 60.0, "decode_rows": 4, "prefill_tokens": 0,
         "path": "capture", "age_s": 3.0}]
    assert slow_steps((), 1.0) == []
