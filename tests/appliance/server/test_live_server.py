"""A real uvicorn server on 127.0.0.1: clients dropping at random points abort their
requests and give every KV page back; graceful shutdown; `mbufo models load|unload`."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_harness import TINY_SPEC, LiveServer, make_settings

from appliance.cli import serve_command
from appliance.db import open_database
from appliance.usage import UsageService
from engine.synthetic import write_synthetic_gguf

MESSAGES = [{"role": "user", "content": "Tell me a story about a fox."}]
NUM_DROPS = 200
LONG = 200  # tokens a dropped request asks for


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_gguf):
    settings = make_settings(tmp_path_factory.mktemp("live"), [str(tiny_gguf)], context=512)
    server = LiveServer(settings).start()
    yield server
    if server.thread.is_alive():
        server.stop()


def _key(live, name: str, **quota) -> str:
    resp = httpx.post(live.url + "/admin/api/keys", headers={
        "Authorization": f"Bearer {live.admin_key}"}, json={"name": name, "user": name,
                                                             "quota": quota})
    assert resp.status_code == 201, resp.text
    return resp.json()["key"]


def _raw(port: int, key: str, body: dict, *, read: int | None, delay: float,
         reset: bool) -> bytes:
    """Send one request on a raw socket, read `read` bytes (None: all), then drop it;
    returns what was read."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    got = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + payload)
        time.sleep(delay)
        while read is None or len(got) < read:
            data = sock.recv(4096 if read is None else min(4096, read - len(got)))
            if not data:
                break
            got += data
        if reset:  # RST instead of FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return bytes(got)


def _idle(live, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    gen = live.state.generation
    while True:
        stats = live.state.router.get(None).engine.stats()
        if (gen.num_jobs == 0 and stats is not None and not stats.sessions
                and stats.num_waiting == 0):
            return
        assert time.monotonic() < deadline, (gen.num_jobs, stats and stats.sessions)
        time.sleep(0.05)


def _free_pages(live) -> dict[str, int]:
    return {g.group: g.num_free for g in live.state.router.get(None).engine.stats().kv}


def test_dropped_clients_free_their_pages(live):
    """Dropped requests ask for LONG tokens: were they not aborted, the engine would need
    minutes to work through them and `_idle` would time out. Every request is greedy on
    one prompt, so each cached prefix is part of the baseline's (the longest) sequence."""
    key = _key(live, "dropper", max_pending=1000, max_concurrent_streams=1000)
    body = {"messages": MESSAGES, "max_tokens": LONG, "temperature": 0, "ignore_eos": True}
    full = _raw(live.port, key, {**body, "stream": True}, read=None, delay=0, reset=False)
    assert full.startswith(b"HTTP/1.1 200") and full.count(b"data: ") == LONG + 1, full[:300]
    # ^ one full answer (a token per event, then [DONE]): its pages are the cached baseline
    _idle(live)
    baseline = _free_pages(live)
    steps_before = live.state.router.get(None).engine.stats().num_steps
    rng = random.Random(1234)

    def drop(i: int) -> str:
        mode = rng.choice(["instant", "delay", "partial", "partial", "full"])
        stream = mode == "partial" or rng.random() < 0.5
        read = {"instant": 0, "delay": 0, "full": None}.get(mode, rng.randint(1, 3000))
        delay = rng.uniform(0, 0.4) if mode == "delay" else 0.0
        request = {**body, "stream": stream, "max_tokens": 16 if mode == "full" else LONG}
        _raw(live.port, key, request, read=read, delay=delay, reset=rng.random() < 0.3)
        return mode

    with ThreadPoolExecutor(max_workers=24) as pool:
        modes = list(pool.map(drop, range(NUM_DROPS)))
    assert len(modes) == NUM_DROPS and {"instant", "delay", "partial", "full"} <= set(modes)
    _idle(live, timeout=5.0)
    assert _free_pages(live) == baseline
    # Unaborted, the ~160 dropped requests decode LONG tokens each: ~160 * LONG / sessions
    # steps (measured: 5,700). Aborted, they stop within a step or two (measured: 350).
    steps = live.state.router.get(None).engine.stats().num_steps - steps_before
    assert steps < NUM_DROPS * LONG / live.settings.sessions / 8, steps
    handle = live.state.router.get(None)
    assert handle.num_in_flight == 0 and not live.state.generation._per_key
    metrics = httpx.get(live.url + "/metrics").text
    aborted = [line for line in metrics.splitlines()
               if line.startswith("mbufo:request_success_total") and "abort" in line]
    assert aborted and sum(float(line.split()[-1]) for line in aborted) >= NUM_DROPS // 4


def _cli(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    serve_command.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = args.handler(args)
    return code, out.getvalue()


def test_models_load_and_unload_cli(live, tmp_path):
    second = tmp_path / "second.gguf"
    write_synthetic_gguf(second, TINY_SPEC, live.state.router.get(None).engine.loaded.path,
                         seed=3)  # the vocabulary of the first model
    auth = ["--url", live.url, "--api-key", live.admin_key, "--json"]
    code, out = _cli(["models", "load", str(second), "--sessions", "2", *auth])
    assert code == 0, out
    loaded = json.loads(out.strip().splitlines()[-1])
    assert loaded["name"] == "second" and loaded["sessions"] == 2
    models = httpx.get(live.url + "/v1/models", headers={
        "Authorization": f"Bearer {live.admin_key}"}).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "second"]
    code, _ = _cli(["models", "load", str(second), *auth])
    assert code == 1  # already loaded: 409
    code, out = _cli(["models", "unload", "second", *auth])
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["unloaded"] is True
    code, _ = _cli(["models", "unload", "second", "--url", live.url, "--api-key", "bad"])
    assert code == 1


def test_graceful_shutdown_ends_streams_clearly_and_flushes_usage(tmp_path, tiny_gguf):
    settings = make_settings(tmp_path / "data", [str(tiny_gguf)], context=1024)
    server = LiveServer(settings, grace_s=1.0).start()
    headers = {"Authorization": f"Bearer {server.admin_key}"}
    lines: list[str] = []
    started = threading.Event()

    def long_stream() -> None:
        body = {"messages": MESSAGES, "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                          headers=headers, timeout=60) as resp:
            for line in resp.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=long_stream)
    reader.start()
    assert started.wait(30)
    server.stop()
    reader.join(30)
    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
    db = open_database(settings)
    try:
        rows = UsageService(db).summary()
    finally:
        db.close()
    assert len(rows) == 1 and rows[0]["requests"] == 1
    assert 0 < rows[0]["completion_tokens"] < 900
