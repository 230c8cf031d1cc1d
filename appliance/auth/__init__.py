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

__all__ = ["NO_AUTH_PRINCIPAL", "ROLES", "AuthError", "KeyInfo", "KeyService", "Principal",
           "Quota", "check_model_allowed", "require_admin", "validate_quota"]
