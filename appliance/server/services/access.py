"""Who a request runs as: the API key in `Authorization: Bearer`, or the local admin when
the server runs with no_auth (loopback only; Settings refuses it elsewhere).

A malformed header is refused on the event loop (no database work); a well-formed key
is checked by KeyService in a worker thread, since a cache miss reads SQLite.
"""

from __future__ import annotations

import asyncio
from typing import Any

from appliance.auth import NO_AUTH_PRINCIPAL, Principal, require_admin
from appliance.auth.keys import parse_authorization


class AccessService:
    def __init__(self, keys: Any, no_auth: bool = False) -> None:
        self.keys = keys
        self.no_auth = no_auth

    async def principal(self, authorization: str | None) -> Principal:
        if self.no_auth:
            return NO_AUTH_PRINCIPAL
        parse_authorization(authorization)  # AuthError 401 for a missing/malformed key
        return await asyncio.to_thread(self.keys.authenticate, authorization)

    async def admin(self, authorization: str | None) -> Principal:
        principal = await self.principal(authorization)
        require_admin(principal)  # AuthError 403 for user keys
        return principal
