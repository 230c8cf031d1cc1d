"""API keys, principals and quota checks. See appliance/auth/keys.py for the key format."""

from __future__ import annotations

from appliance.auth.service import KeyService
from appliance.auth.types import (
    NO_AUTH_PRINCIPAL,
    ROLES,
    AuthError,
    KeyInfo,
    Principal,
    Quota,
    check_model_allowed,
    require_admin,
    validate_quota,
)
from appliance.db import Database

__all__ = ["NO_AUTH_PRINCIPAL", "ROLES", "AuthError", "KeyInfo", "KeyService", "Principal",
           "Quota", "check_model_allowed", "ensure_admin_key", "require_admin", "validate_quota"]


def ensure_admin_key(db: Database) -> str | None:
    """First start: a new admin key (to print once) when no active admin key exists."""
    return KeyService(db).ensure_admin_key()
