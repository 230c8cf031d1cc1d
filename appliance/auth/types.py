"""Values of the auth layer: a key's quota, the principal a request runs as, key listings."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from appliance.db.errors import StateError

ROLES = ("admin", "user")


class AuthError(Exception):
    """401 (no usable key: invalid_api_key, revoked_api_key, expired_api_key) or 403
    (forbidden, model_not_allowed). The message never contains the presented secret."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Quota:
    """A client quota. None = unlimited (allowed_models None = every model)."""

    allowed_models: tuple[str, ...] | None = None
    max_pending: int = 16
    max_concurrent_streams: int = 4
    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    tokens_per_day: int | None = None
    expires_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["allowed_models"] = None if self.allowed_models is None else list(self.allowed_models)
        out["expires_at"] = _iso(self.expires_at)
        return out


@dataclass(frozen=True, slots=True)
class Principal:
    key_id: str
    user: str
    role: str  # "admin" | "user"
    quota: Quota

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"


# What a server started with no_auth (loopback only) runs requests as.
NO_AUTH_PRINCIPAL = Principal(key_id="local", user="local", role="admin", quota=Quota())


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """A key as listed: never the secret, never its hash."""

    key_id: str
    name: str
    user: str
    role: str
    created_at: datetime
    revoked_at: datetime | None
    expires_at: datetime | None
    last_used_at: datetime | None
    quota: Quota

    def status(self, now: datetime) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and now >= self.expires_at:
            return "expired"
        return "active"

    def to_dict(self, now: datetime) -> dict[str, Any]:
        return {"id": self.key_id, "name": self.name, "user": self.user, "role": self.role,
                "status": self.status(now), "created_at": _iso(self.created_at),
                "revoked_at": _iso(self.revoked_at), "expires_at": _iso(self.expires_at),
                "last_used_at": _iso(self.last_used_at), "quota": self.quota.to_dict()}


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


def validate_quota(quota: Quota) -> None:
    """StateError naming the field when a quota value is out of range."""
    for name in ("max_pending", "max_concurrent_streams"):
        value = getattr(quota, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StateError(f"quota {name} must be an integer >= 1, got {value!r}")
    for name in ("requests_per_min", "tokens_per_min", "tokens_per_day"):
        value = getattr(quota, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise StateError(f"quota {name} must be None (unlimited) or an integer >= 1, "
                             f"got {value!r}")
    models = quota.allowed_models
    if models is not None and (not isinstance(models, tuple)
                               or not all(isinstance(m, str) and m for m in models)):
        raise StateError(f"quota allowed_models must be None or a tuple of names, got {models!r}")
    if quota.expires_at is not None and quota.expires_at.tzinfo is None:
        raise StateError("quota expires_at must be timezone-aware")


def check_model_allowed(principal: Principal, model: str) -> None:
    allowed = principal.quota.allowed_models
    if allowed is not None and model not in allowed:
        raise AuthError(403, "model_not_allowed",
                        f"API key {principal.key_id} may not use model '{model}'")


def require_admin(principal: Principal) -> None:
    if principal.role != "admin":
        raise AuthError(403, "forbidden", "this endpoint needs an admin API key")
