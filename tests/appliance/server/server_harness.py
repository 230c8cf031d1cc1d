"""Helpers for the server tests: settings on a fresh data directory, a server state with
the real state services and in-process clients (httpx over ASGI, the official openai
package on top), and the OpenAI error-shape assertion."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from appliance.server import ServerState, create_app, open_state
from appliance.settings import load_settings
from engine.synthetic import SyntheticSpec

TINY_SPEC = SyntheticSpec("llama", context_length=1024)


def make_settings(data_dir: Path, models: list[str], **overrides: Any):
    cli = {"data_dir": str(data_dir), "models": models, "sessions": 4, "context": 256,
           "prefill_chunk": 64, **overrides}
    return load_settings(cli, environ={})


@dataclass
class Harness:
    """One server state, its app, and clients talking to it in-process."""

    state: ServerState
    app: Any
    admin_key: str | None
    http: httpx.AsyncClient

    def openai(self, key: str | None = None) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://t")
        return openai.AsyncOpenAI(api_key=key or self.admin_key or "none",
                                  base_url="http://t/v1", http_client=http, max_retries=0)

    def auth(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.admin_key}"}

    async def create_key(self, name: str, user: str, role: str = "user",
                         **quota: Any) -> tuple[str, str]:
        """(key, key id) through the admin API."""
        body: dict[str, Any] = {"name": name, "user": user, "role": role}
        if quota:
            body["quota"] = quota
        resp = await self.http.post("/admin/api/keys", json=body, headers=self.auth())
        assert resp.status_code == 201, resp.text
        data = resp.json()
        return data["key"], data["id"]

    async def close(self) -> None:
        await self.http.aclose()
        await self.state.close()


async def start_harness(data_dir: Path, models: list[str], **overrides: Any) -> Harness:
    settings = make_settings(data_dir, models, **overrides)
    state = open_state(settings)
    admin_key = None if settings.no_auth else state.keys.ensure_admin_key()
    app = create_app(state, start_models=False)
    await state.start()
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return Harness(state, app, admin_key, http)


def assert_openai_error(resp: Any, status: int, code: str | None = None) -> dict:
    """The response has `status` and OpenAI's error body; returns the error object."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    return err


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def status_code(self) -> int:
        return self.status

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)


async def asgi_request(app: Any, method: str, path: str, *, headers: dict[str, bytes] | None = None,
                       body: bytes = b"") -> RawResponse:
    """One request straight into the ASGI app: no HTTP client in between, so thousands of
    requests stay fast. Header values are bytes (any bytes a client could send)."""
    raw_headers = [(k.lower().encode(), v) for k, v in (headers or {}).items()]
    if body:
        raw_headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": raw_headers,
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8080)}
    sent = False
    done = asyncio.Event()
    out: dict[str, Any] = {"status": 0, "headers": {}, "body": []}

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode().lower(): v.decode("latin-1")
                              for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            out["body"].append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    done.set()
    return RawResponse(out["status"], out["headers"], b"".join(out["body"]))


class LiveServer:
    """A real uvicorn server on 127.0.0.1 (random port) in a thread, with the app's own
    lifespan: startup loads the configured models, shutdown drains and flushes."""

    def __init__(self, settings: Any, grace_s: float = 5.0) -> None:
        import socket
        import threading

        from appliance.cli.serve_command import build_server

        self.settings = settings
        self.state = open_state(settings)
        self.admin_key = self.state.keys.ensure_admin_key()
        self.app = create_app(self.state)
        self.server = build_server(self.app, self.state, "127.0.0.1", 0, grace_s=grace_s,
                                   log_level="warning")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def start(self, timeout: float = 60.0) -> LiveServer:
        import time

        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server did not stop"
