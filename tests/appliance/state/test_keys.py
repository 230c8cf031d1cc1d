"""API keys: format, shown once, only the hash stored, rejection of every bad header with
the right code, constant-time comparison, the verified-key cache, quotas, first admin."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import logging
import re
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import event

from appliance.auth import (
    AuthError,
    KeyInfo,
    KeyService,
    Principal,
    Quota,
    check_model_allowed,
    require_admin,
)
from appliance.db import Database, StateError

# Written from the specification, not imported from the code under test.
KEY_FORMAT = re.compile(r"mbufo_([A-Za-z0-9]{8,12})_([A-Za-z0-9]+)")
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def stored_hash(db: Database, key_id: str) -> str:
    with sqlite3.connect(db.path) as conn:
        return conn.execute("SELECT secret_sha256 FROM api_keys WHERE id=?",
                            (key_id,)).fetchone()[0]


def database_bytes(db: Database) -> bytes:
    return b"".join(p.read_bytes() for p in Path(db.path).parent.glob("mbufo.db*"))


def test_key_format_and_randomness(db: Database) -> None:
    service = KeyService(db)
    key, info = service.create(name="laptop", user="alice", role="user")
    match = KEY_FORMAT.fullmatch(key)
    assert match is not None, key
    key_id, secret = match.groups()
    assert key_id == info.key_id
    # 62**n >= 2**256: at least 32 bytes of randomness fit in the secret
    assert len(secret) * 5.954 >= 256
    keys = {service.create(name=f"k{i}", user="alice", role="user")[0] for i in range(20)}
    assert len({KEY_FORMAT.fullmatch(k).group(2) for k in keys}) == 20
    assert len({KEY_FORMAT.fullmatch(k).group(1) for k in keys}) == 20


def test_only_the_sha256_of_the_secret_is_stored_or_logged(
        db: Database, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    # SQL statements and their parameters (INFO); DEBUG would add result rows, which hold
    # the stored hash: harmless (the secret has 256 bits) but not worth logging either.
    logging.getLogger("sqlalchemy.engine").setLevel(logging.INFO)
    try:
        service = KeyService(db)
        key, info = service.create(name="laptop", user="alice", role="user")
        secret = KEY_FORMAT.fullmatch(key).group(2)
        digest = hashlib.sha256(secret.encode()).hexdigest()
        assert stored_hash(db, info.key_id) == digest
        assert service.authenticate(f"Bearer {key}").key_id == info.key_id
        listing = service.list()
        service.revoke(info.key_id)
        with pytest.raises(AuthError):
            service.authenticate(f"Bearer {key}")
    finally:
        logging.getLogger("sqlalchemy.engine").setLevel(logging.NOTSET)
    assert "SELECT" in caplog.text  # the SQL log was on
    blob = database_bytes(db)
    for needle in (secret, key):
        assert needle.encode() not in blob
        assert needle not in caplog.text
    assert digest not in caplog.text  # bound parameters are hidden
    shown = json.dumps([i.to_dict(T0) for i in listing]) + repr(listing)
    assert secret not in shown and digest not in shown
    names = {f.name for f in dataclasses.fields(KeyInfo)}
    assert not any("hash" in n or "secret" in n for n in names)


def test_authenticate_returns_the_principal(db: Database) -> None:
    service = KeyService(db)
    quota = Quota(allowed_models=("m1",), max_pending=3, max_concurrent_streams=2,
                  requests_per_min=10, tokens_per_min=1000, tokens_per_day=5000)
    key, info = service.create(name="bot", user="bob", role="admin", quota=quota)
    principal = service.authenticate(f"Bearer {key}")
    assert principal == Principal(key_id=info.key_id, user="bob", role="admin", quota=quota)
    assert service.authenticate(f"bearer   {key}  ").key_id == info.key_id  # scheme any case
    assert service.get(info.key_id).last_used_at is not None


def malformed(key: str) -> list[str | None]:
    key_id, secret = KEY_FORMAT.fullmatch(key).groups()
    return [
        None, "", "   ", "Bearer", "Bearer ", key, f"Basic {key}", f"Token {key}",
        f"Bearer{key}", f"Bearer {key} {key}",
        f"Bearer MBUFO_{key_id}_{secret}", f"Bearer mbufox_{key_id}_{secret}",
        f"Bearer sk-{secret}", f"Bearer {secret}", f"Bearer mbufo{key_id}{secret}",
        f"Bearer mbufo_{key_id}", f"Bearer mbufo_{key_id}_", f"Bearer mbufo__{secret}",
        f"Bearer mbufo_{key_id}_{secret}_extra", f"Bearer mbufo_{key_id}_extra_{secret}",
        f"Bearer mbufo_{key_id}__{secret}", f"Bearer _mbufo_{key_id}_{secret}",
        f"Bearer mbufo_{key_id}_{secret[:-1]}+", f"Bearer mbufo_{key_id}_{secret[:-1]}/",
        f"Bearer mbufo_{key_id}_{secret[:-1]}=", f"Bearer mbufo_{key_id}_{secret[:-1]}-",
        f"Bearer mbufo_{key_id}_{secret}==", f"Bearer mbufo_{key_id[:-1]}._{secret}",
        f"Bearer mbufo_abc_{secret}", f"Bearer mbufo_{'a' * 13}_{secret}",
        f"Bearer mbufo_{key_id}_{secret[:20]}",
        f"Bearer mbufo_{key_id}_{secret[:-1]}é", f"Bearer mbufo_{key_id}_{secret[:-1]}０",
        f"Bearer mbufo_{key_id}_{secret[:-1]}а",  # Cyrillic a
        f"Bearer mbufo_{key_id[:-1]}ß_{secret}", f"Bearer mbufo_{key_id}_{secret}\n",
        f"Bearer mbufo_{key_id}_{secret}\x00", f"Bearer mbufo_{key_id}_{secret[:-1]}\u200b",
        f"Bearer mbufo_{key_id}_{'A' * 200}",
    ]


def test_malformed_headers_are_401_invalid_api_key(db: Database) -> None:
    service = KeyService(db)
    key, _ = service.create(name="laptop", user="alice", role="user")
    variants = malformed(key)
    assert len(set(variants)) == len(variants)
    for header in variants:
        with pytest.raises(AuthError) as info:
            service.authenticate(header)
            pytest.fail(f"accepted {header!r}")
        assert (info.value.status, info.value.code) == (401, "invalid_api_key"), repr(header)
        secret = KEY_FORMAT.fullmatch(key).group(2)
        assert secret not in info.value.message


def test_wrong_secret_and_unknown_id_are_401(db: Database) -> None:
    service = KeyService(db)
    key, info = service.create(name="laptop", user="alice", role="user")
    other, _ = service.create(name="phone", user="alice", role="user")
    wrong_secret = f"mbufo_{info.key_id}_{KEY_FORMAT.fullmatch(other).group(2)}"
    unknown_id = f"mbufo_ZZZZZZZZZZ_{KEY_FORMAT.fullmatch(key).group(2)}"
    for token in (wrong_secret, unknown_id):
        with pytest.raises(AuthError) as err:
            service.authenticate(f"Bearer {token}")
        assert (err.value.status, err.value.code) == (401, "invalid_api_key")


def test_secrets_are_compared_with_compare_digest(db: Database,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    service = KeyService(db)
    key, info = service.create(name="laptop", user="alice", role="user")
    calls: list[tuple] = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)
    service.authenticate(f"Bearer {key}")
    assert len(calls) == 1 and stored_hash(db, info.key_id) in calls[0]
    service.authenticate(f"Bearer {key}")  # cached: still compared
    assert len(calls) == 2
    with pytest.raises(AuthError):
        service.authenticate(f"Bearer mbufo_{info.key_id}_{'x' * 43}")
    with pytest.raises(AuthError):
        service.authenticate(f"Bearer mbufo_NoSuchKey1_{'x' * 43}")
    assert len(calls) == 4  # unknown ids cost a comparison too


def test_revoked_key_is_401_revoked_at_once(db: Database) -> None:
    service = KeyService(db, cache_ttl_s=3600)
    key, info = service.create(name="laptop", user="alice", role="user")
    service.authenticate(f"Bearer {key}")  # now cached
    assert service.revoke(info.key_id) is True
    assert service.revoke(info.key_id) is False
    assert service.revoke("NoSuchKey1") is False
    with pytest.raises(AuthError) as err:
        service.authenticate(f"Bearer {key}")
    assert (err.value.status, err.value.code) == (401, "revoked_api_key")
    assert service.get(info.key_id).status(T0) == "revoked"


def test_expired_key_is_401_expired(db: Database, clock) -> None:
    now = [T0]
    service = KeyService(db, clock=clock, now=lambda: now[0])
    key, _ = service.create(name="temp", user="alice", role="user",
                            quota=Quota(expires_at=T0 + timedelta(hours=1)))
    service.authenticate(f"Bearer {key}")  # cached from here
    now[0] = T0 + timedelta(hours=1)
    with pytest.raises(AuthError) as err:
        service.authenticate(f"Bearer {key}")
    assert (err.value.status, err.value.code) == (401, "expired_api_key")


def test_cache_spares_sqlite_and_sees_other_processes_after_ttl(db: Database, clock) -> None:
    selects: list[str] = []

    def count(conn, cursor, statement, *args) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "api_keys" in statement:
            selects.append(statement)

    service = KeyService(db, cache_ttl_s=5.0, clock=clock)
    key, info = service.create(name="laptop", user="alice", role="user")
    event.listen(db.engine, "before_cursor_execute", count)
    try:
        for _ in range(1000):
            service.authenticate(f"Bearer {key}")
        assert len(selects) == 1
        KeyService(db).revoke(info.key_id)  # another process (the CLI) revokes
        clock.advance(4.9)
        service.authenticate(f"Bearer {key}")  # within the TTL: still the cached entry
        clock.advance(0.2)
        with pytest.raises(AuthError) as err:
            service.authenticate(f"Bearer {key}")
        assert err.value.code == "revoked_api_key" and len(selects) == 3  # load, revoke, reload
    finally:
        event.remove(db.engine, "before_cursor_execute", count)


def test_set_quota_and_model_checks(db: Database) -> None:
    service = KeyService(db, cache_ttl_s=3600)
    key, info = service.create(name="laptop", user="alice", role="user")
    principal = service.authenticate(f"Bearer {key}")
    assert principal.quota == Quota()  # defaults: 16 pending, 4 streams, unlimited
    check_model_allowed(principal, "anything")
    new = Quota(allowed_models=("small",), max_pending=2, max_concurrent_streams=1,
                tokens_per_day=100, expires_at=T0)
    service.set_quota(info.key_id, new)
    assert service.list()[0].quota == new
    assert service.authenticate(f"Bearer {key}").quota == new  # the cached entry was dropped
    with pytest.raises(AuthError) as err:
        check_model_allowed(Principal(info.key_id, "alice", "user", new), "large")
    assert (err.value.status, err.value.code) == (403, "model_not_allowed")
    with pytest.raises(StateError) as missing:
        service.set_quota("NoSuchKey1", new)
    assert missing.value.status == 404


@pytest.mark.parametrize("bad", [
    Quota(max_pending=0), Quota(max_concurrent_streams=-1), Quota(requests_per_min=0),
    Quota(tokens_per_min=True), Quota(tokens_per_day=1.5), Quota(allowed_models=("",)),
    Quota(allowed_models=["a"]), Quota(expires_at=datetime(2030, 1, 1))])
def test_bad_quotas_are_refused(db: Database, bad: Quota) -> None:
    with pytest.raises(StateError):
        KeyService(db).create(name="k", user="u", role="user", quota=bad)
    assert KeyService(db).list() == []


def test_bad_roles_and_names_are_refused(db: Database) -> None:
    service = KeyService(db)
    for kwargs in ({"name": "k", "user": "u", "role": "root"},
                   {"name": "", "user": "u", "role": "user"},
                   {"name": "k", "user": " ", "role": "user"},
                   {"name": "k" * 129, "user": "u", "role": "user"}):
        with pytest.raises(StateError):
            service.create(**kwargs)
    assert service.list() == []


def test_require_admin(db: Database) -> None:
    service = KeyService(db)
    user_key, _ = service.create(name="u", user="u", role="user")
    admin_key, _ = service.create(name="a", user="a", role="admin")
    require_admin(service.authenticate(f"Bearer {admin_key}"))
    with pytest.raises(AuthError) as err:
        require_admin(service.authenticate(f"Bearer {user_key}"))
    assert (err.value.status, err.value.code) == (403, "forbidden")


def test_ensure_admin_key_function(db: Database) -> None:
    from appliance.auth import ensure_admin_key

    key = ensure_admin_key(db)
    assert key is not None and KeyService(db).authenticate(f"Bearer {key}").role == "admin"
    assert ensure_admin_key(db) is None


def test_ensure_admin_key(db: Database) -> None:
    now = [T0]
    service = KeyService(db, now=lambda: now[0])
    service.create(name="u", user="u", role="user")  # a user key is not enough
    first = service.ensure_admin_key()
    assert first is not None
    principal = service.authenticate(f"Bearer {first}")
    assert principal.role == "admin"
    assert service.ensure_admin_key() is None
    service.revoke(principal.key_id)
    second = service.ensure_admin_key()
    assert second is not None and second != first
    # an expired admin key does not count as active
    service.set_quota(service.authenticate(f"Bearer {second}").key_id,
                      Quota(expires_at=T0 + timedelta(days=1)))
    now[0] = T0 + timedelta(days=2)
    assert service.ensure_admin_key() is not None
    roles = [(i.role, i.status(now[0])) for i in service.list()]
    assert roles.count(("admin", "active")) == 1
