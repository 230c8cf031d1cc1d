"""Security headers on every response (API, metrics, errors, and the dashboard to come).

A `before_send` hook rather than a middleware: Litestar runs before_send for every
message the app sends, including 404/405 answers for unknown routes, which route
middleware never sees. The CSP allows only same-origin scripts, styles and connections
(htmx and its SSE stream are served by this server), no framing, no plugins, no base or
form targets elsewhere.
"""

from __future__ import annotations

from litestar.datastructures import MutableScopeHeaders
from litestar.types import Message, Scope

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": ("default-src 'self'; script-src 'self'; style-src 'self'; "
                                "img-src 'self' data:; connect-src 'self'; object-src 'none'; "
                                "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    "Cross-Origin-Opener-Policy": "same-origin",
}


async def security_headers(message: Message, scope: Scope) -> None:
    if message["type"] == "http.response.start":
        headers = MutableScopeHeaders.from_message(message)
        for name, value in SECURITY_HEADERS.items():
            headers[name] = value
