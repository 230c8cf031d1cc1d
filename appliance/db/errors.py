"""The error the state services raise for bad input or a missing/conflicting row.

It carries an HTTP `status` and a machine `code` like AuthError and RateLimited, so one
exception hook can map all of them to OpenAI-shaped JSON."""

from __future__ import annotations


class StateError(ValueError):
    """Invalid argument (400 invalid_request), unknown row (404 not_found), duplicate (409)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
