"""Auth at the HTTP edge: 10,000 requests with missing, malformed, wrong-prefix, revoked,
expired and other users' keys all get 401/403 with OpenAI-shaped bodies, and no key
secret appears in the logs, the database files or any response."""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from server_harness import asgi_request, assert_openai_error, start_harness

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
ENDPOINTS = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
             ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
             ("GET", "/admin/api/keys", None), ("GET", "/admin/api/state", None),
             ("POST", "/admin/api/models/unload", {"name": "tiny"})]
NUM_REQUESTS = 10_000


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, tiny_gguf):
    h = await start_harness(tmp_path_factory.mktemp("auth"), [str(tiny_gguf)])
    yield h
    await h.close()


async def _keys(h) -> dict[str, str]:
    """Keys of every kind the cases below use (admin first)."""
    alice, alice_id = await h.create_key("alice-laptop", "alice")
    bob, bob_id = await h.create_key("bob-phone", "bob", allowed_models=["elsewhere"])
    revoked, revoked_id = await h.create_key("old", "carol")
    expired, expired_id = await h.create_key("temp", "dave")
    resp = await h.http.post(f"/admin/api/keys/{revoked_id}/revoke", headers=h.auth())
    assert resp.status_code == 200 and resp.json()["revoked"]
    past = (datetime.now(UTC) - timedelta(minutes=1)).isoformat()
    resp = await h.http.patch(f"/admin/api/keys/{expired_id}/quota", headers=h.auth(),
                              json={"expires_at": past})
    assert resp.status_code == 200, resp.text
    return {"admin": h.admin_key, "alice": alice, "bob": bob, "revoked": revoked,
            "expired": expired}


def _cases(keys: dict[str, str]) -> list[tuple[str, int, set[str]]]:
    """(Authorization header or '' for none, status, acceptable codes) per kind."""
    alice_id, alice_secret = keys["alice"].split("_")[1:]
    bob_id = keys["bob"].split("_")[1]
    invalid = {"invalid_api_key"}
    other = "B" if alice_secret.endswith("A") else "A"  # a last character that differs
    return [
        ("", 401, invalid),
        ("Bearer", 401, invalid), ("Bearer ", 401, invalid), ("Basic YWxhZGRpbjpvcGVu", 401,
                                                              invalid),
        ("Bearer mbufo_", 401, invalid), ("Bearer mbufo_abc_def", 401, invalid),
        ("Bearer " + "x" * 5000, 401, invalid), ("Bearer mbufo_ΑΒΓΔΕΖΗΘΙΚ_ünïcödé", 401, invalid),
        (f"Token {keys['alice']}", 401, invalid), (keys["alice"], 401, invalid),
        (f"Bearer sk-{alice_secret}", 401, invalid),
        (f"Bearer mbufx_{alice_id}_{alice_secret}", 401, invalid),
        (f"Bearer {keys['alice']}x", 401, invalid),
        (f"Bearer mbufo_{alice_id}_{alice_secret[:-1]}{other}", 401, invalid),  # wrong secret
        (f"Bearer mbufo_{bob_id}_{alice_secret}", 401, invalid),  # another user's id
        (f"Bearer mbufo_ZZZZZZZZZZ_{alice_secret}", 401, invalid),  # unknown id
        (f"Bearer {keys['revoked']}", 401, {"revoked_api_key"}),
        (f"Bearer {keys['expired']}", 401, {"expired_api_key"}),
    ]


async def test_bad_keys_get_401_or_403_and_secrets_never_leak(harness, caplog):
    caplog.set_level(logging.DEBUG)
    keys = await _keys(harness)
    cases = _cases(keys)
    rng = random.Random(0)
    bodies: list[bytes] = []
    seen_codes: dict[tuple[int, str], int] = {}

    async def one(i: int) -> None:
        method, path, body = ENDPOINTS[i % len(ENDPOINTS)]
        if i % 7 == 0:  # other users' keys where they do not reach
            header, status = f"Bearer {keys['alice' if 'admin' in path else 'bob']}", 403
            codes = {"forbidden"} if "admin" in path else {"model_not_allowed"}
            if path == "/v1/models":  # listing is allowed; bob sees none of the models
                header, status, codes = f"Bearer {keys['bob']}", 200, set()
        else:
            header, status, codes = rng.choice(cases)
        headers = {"Authorization": header.encode()} if header else {}
        payload = msgspec.json.encode(body) if body is not None else b""
        resp = await asgi_request(harness.app, method, path, headers=headers, body=payload)
        bodies.append(resp.body + repr(resp.headers).encode())
        if status == 200:
            assert resp.status_code == 200 and resp.json()["data"] == [], resp.text
            return
        err = assert_openai_error(resp, status)
        assert err["code"] in codes, (header[:40], path, err)
        if status == 401:
            assert resp.headers["www-authenticate"] == "Bearer"
        seen_codes[(status, err["code"])] = seen_codes.get((status, err["code"]), 0) + 1

    for start in range(0, NUM_REQUESTS, 200):
        await asyncio.gather(*(one(i) for i in range(start, min(start + 200, NUM_REQUESTS))))
    assert {code for _, code in seen_codes} == {"invalid_api_key", "revoked_api_key",
                                                "expired_api_key", "forbidden",
                                                "model_not_allowed"}
    listing = await harness.http.get("/admin/api/keys", headers=harness.auth())
    metrics = await harness.http.get("/metrics")
    bodies += [listing.content, metrics.content]
    _assert_no_secret(keys, bodies, caplog, harness.state.settings.data_dir)


def _assert_no_secret(keys, bodies, caplog, data_dir) -> None:
    secrets = [k.split("_", 2)[2] for k in keys.values()]  # the part after the public id
    logs = "\n".join(r.getMessage() + repr(r.args) for r in caplog.records)
    assert len(caplog.records) > 100  # the logs were captured
    files = b"".join(p.read_bytes() for p in data_dir.iterdir() if p.is_file())
    assert len(files) > 10_000
    for secret in secrets:
        assert secret not in logs
        assert secret.encode() not in files
        assert not any(secret.encode() in b for b in bodies)


async def test_valid_keys_pass(harness):
    key, key_id = await harness.create_key("ok", "erin")
    resp = await harness.http.get("/v1/models", headers=harness.auth(key))
    assert resp.status_code == 200 and [m["id"] for m in resp.json()["data"]] == ["tiny"]
    resp = await harness.http.get("/admin/api/keys", headers=harness.auth(key))
    assert_openai_error(resp, 403, "forbidden")
    resp = await harness.http.get("/admin/api/keys", headers=harness.auth())
    listed = {k["id"]: k for k in resp.json()["data"]}
    assert listed[key_id]["user"] == "erin" and listed[key_id]["status"] == "active"
