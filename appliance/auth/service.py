"""KeyService: create, authenticate, list, revoke keys and set their quotas.

Verified keys are cached for `cache_ttl_s` (5 s) so a burst of requests does not read
SQLite once each. The cache holds the stored hash, never the secret: a cached entry still
checks every presented secret with hmac.compare_digest. revoke() and set_quota() drop the
entry at once in this process; a change made by another process (the CLI) is seen within
the TTL.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from appliance.auth import keys
from appliance.auth.types import (
    ROLES,
    AuthError,
    KeyInfo,
    Principal,
    Quota,
    validate_quota,
)
from appliance.db import Database, StateError
from appliance.db.models import ApiKey, KeyQuota, User
from appliance.db.types import utcnow

log = logging.getLogger(__name__)

_DUMMY_HASH = keys.hash_secret("0" * keys.SECRET_LENGTH)  # compared when the id is unknown


@dataclass(frozen=True, slots=True)
class _Entry:
    secret_sha256: str
    principal: Principal
    revoked: bool
    loaded_at: float


class KeyService:
    def __init__(self, db: Database, *, cache_ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 now: Callable[[], datetime] = utcnow) -> None:
        self._db = db
        self._ttl = cache_ttl_s
        self._clock = clock
        self._now = now
        self._cache: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def create(self, *, name: str, user: str, role: str,
               quota: Quota | None = None) -> tuple[str, KeyInfo]:
        """(the full key, its info). The key is returned here only; it cannot be recovered."""
        with self._db.session(write=True) as session:
            return self._create(session, name=name, user=user, role=role, quota=quota)

    def authenticate(self, authorization_header: str | None) -> Principal:
        key_id, secret = keys.parse_authorization(authorization_header)
        presented = keys.hash_secret(secret)
        entry, is_fresh = self._entry(key_id)
        if entry is None:
            hmac.compare_digest(presented, _DUMMY_HASH)  # same work for unknown ids
            raise AuthError(401, "invalid_api_key", "invalid API key")
        if not hmac.compare_digest(presented, entry.secret_sha256):
            raise AuthError(401, "invalid_api_key", "invalid API key")
        if entry.revoked:
            raise AuthError(401, "revoked_api_key", f"API key {key_id} has been revoked")
        expires_at = entry.principal.quota.expires_at
        if expires_at is not None and self._now() >= expires_at:
            raise AuthError(401, "expired_api_key",
                            f"API key {key_id} expired at {expires_at.isoformat()}")
        if is_fresh:
            self._touch(key_id)
        return entry.principal

    def list(self) -> list[KeyInfo]:
        with self._db.session() as session:
            rows = session.scalars(select(ApiKey).order_by(ApiKey.created_at, ApiKey.id))
            return [_info(row) for row in rows.unique()]

    def get(self, key_id: str) -> KeyInfo | None:
        with self._db.session() as session:
            row = session.get(ApiKey, key_id)
            return None if row is None else _info(row)

    def revoke(self, key_id: str) -> bool:
        """True if the key existed and was active until now."""
        try:
            with self._db.session(write=True) as session:
                row = session.get(ApiKey, key_id)
                if row is None or row.revoked_at is not None:
                    return False
                row.revoked_at = self._now()
        finally:
            self._forget(key_id)
        log.info("revoked API key %s", key_id)
        return True

    def set_quota(self, key_id: str, quota: Quota) -> None:
        validate_quota(quota)
        try:
            with self._db.session(write=True) as session:
                row = session.get(ApiKey, key_id)
                if row is None:
                    raise StateError(f"no API key with id {key_id}", status=404,
                                     code="not_found")
                row.expires_at = quota.expires_at
                if row.quota is None:
                    row.quota = KeyQuota(key_id=key_id)
                _store_quota(row.quota, quota)
        finally:
            self._forget(key_id)
        log.info("set the quota of API key %s", key_id)

    def ensure_admin_key(self) -> str | None:
        """Create an admin key when no active admin key exists; return it (shown once)."""
        with self._db.session(write=True) as session:
            now = self._now()
            active = session.scalar(
                select(ApiKey.id).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None),
                                        (ApiKey.expires_at.is_(None)) | (ApiKey.expires_at > now))
                .limit(1))
            if active is not None:
                return None
            key, _ = self._create(session, name="first-admin", user="admin", role="admin")
            return key

    # -- internals -------------------------------------------------------------------------

    def _create(self, session: Session, *, name: str, user: str, role: str,
                quota: Quota | None = None) -> tuple[str, KeyInfo]:
        if role not in ROLES:
            raise StateError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        for label, value in (("name", name), ("user", user)):
            if not value or not value.strip() or len(value) > 128:
                raise StateError(f"key {label} must be 1-128 characters, got {value!r}")
        quota = quota or Quota()
        validate_quota(quota)
        owner = session.scalar(select(User).where(User.name == user))
        if owner is None:
            owner = User(name=user, created_at=self._now())
            session.add(owner)
        key_id = keys.new_key_id()
        while session.get(ApiKey, key_id) is not None:
            key_id = keys.new_key_id()
        secret = keys.new_secret()
        row = ApiKey(id=key_id, user=owner, role=role, secret_sha256=keys.hash_secret(secret),
                     name=name, created_at=self._now(), expires_at=quota.expires_at,
                     quota=KeyQuota(key_id=key_id))
        _store_quota(row.quota, quota)
        session.add(row)
        session.flush()
        log.info("created %s API key %s (%s) for user %s", role, key_id, name, user)
        return keys.format_key(key_id, secret), _info(row)

    def _entry(self, key_id: str) -> tuple[_Entry | None, bool]:
        """(cache entry or None if the id is unknown, whether it was just read)."""
        now = self._clock()
        with self._lock:
            entry = self._cache.get(key_id)
        if entry is not None and now - entry.loaded_at < self._ttl:
            return entry, False
        with self._db.session() as session:
            row = session.get(ApiKey, key_id)
            if row is None:
                self._forget(key_id)
                return None, True
            entry = _Entry(row.secret_sha256, _principal(row), row.revoked_at is not None, now)
        with self._lock:
            self._cache[key_id] = entry
        return entry, True

    def _touch(self, key_id: str) -> None:
        # Best effort, at most once per key per TTL: a busy database must not fail a request.
        try:
            with self._db.session() as session:
                session.execute(update(ApiKey).where(ApiKey.id == key_id)
                                .values(last_used_at=self._now()))
        except OperationalError as exc:
            log.warning("could not record last use of API key %s: %s", key_id, exc.orig)

    def _forget(self, key_id: str) -> None:
        with self._lock:
            self._cache.pop(key_id, None)


def _store_quota(row: KeyQuota, quota: Quota) -> None:
    row.allowed_models = None if quota.allowed_models is None else list(quota.allowed_models)
    row.max_pending = quota.max_pending
    row.max_concurrent_streams = quota.max_concurrent_streams
    row.requests_per_min = quota.requests_per_min
    row.tokens_per_min = quota.tokens_per_min
    row.tokens_per_day = quota.tokens_per_day


def _quota(row: ApiKey) -> Quota:
    q = row.quota
    if q is None:  # a key written without a quota row gets the defaults
        return Quota(expires_at=row.expires_at)
    models = None if q.allowed_models is None else tuple(q.allowed_models)
    return Quota(allowed_models=models, max_pending=q.max_pending,
                 max_concurrent_streams=q.max_concurrent_streams,
                 requests_per_min=q.requests_per_min, tokens_per_min=q.tokens_per_min,
                 tokens_per_day=q.tokens_per_day, expires_at=row.expires_at)


def _principal(row: ApiKey) -> Principal:
    return Principal(key_id=row.id, user=row.user.name, role=row.role, quota=_quota(row))


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(key_id=row.id, name=row.name, user=row.user.name, role=row.role,
                   created_at=row.created_at, revoked_at=row.revoked_at,
                   expires_at=row.expires_at, last_used_at=row.last_used_at, quota=_quota(row))
