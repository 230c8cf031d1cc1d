"""The appliance's error base class and the one hook that turns any error into OpenAI's shape.

Every error a client sees is `{"error": {"message", "type", "param", "code"}}` with the
matching HTTP status. Errors raised on purpose are `ApiError`s (or engine, auth and rate
limit errors, mapped here by their code); the database's storage failing (a full disk) is
a 503 `storage_unavailable`, its reason logged; anything else is a bug: logged with its
traceback and answered as a 500 that names nothing internal.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException

from engine import errors as engine_errors

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "overloaded_error"}


class ApiError(Exception):
    """An error meant for the client: HTTP status, OpenAI `code`, optional `param`."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 status: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or type(self).code
        self.param = param
        self.status = status or type(self).status
        self.retry_after_s = retry_after_s


class BadRequest(ApiError):
    status, code = 400, "invalid_request"


class Unsupported(ApiError):
    status, code = 400, "unsupported"


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"


class TooManyRequests(ApiError):
    status, code = 429, "rate_limited"


class Unavailable(ApiError):
    status, code = 503, "unavailable"


STORAGE_RETRY_S = 30.0  # a full disk is not freed in a second

# engine error code -> HTTP status (engine/errors.py names the codes)
_ENGINE_STATUS = {
    "invalid_request": 400, "context_length_exceeded": 400, "chat_template": 400,
    "tokenizer": 400, "model_not_found": 404, "gguf_format": 400,
    "unsupported_architecture": 400, "unsupported_tensor_type": 400,
    "client_quota": 429, "overloaded": 503,
    "out_of_kv_pages": 400,  # at submit: the request cannot fit the pool even alone
}


def as_api_error(exc: BaseException) -> ApiError:
    """Any exception -> the ApiError the client sees."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, engine_errors.EngineError):
        status = _ENGINE_STATUS.get(exc.code, 503)
        retry = 1.0 if status in (429, 503) else None
        return ApiError(str(exc), code=exc.code, status=status, retry_after_s=retry)
    mapped = _state_layer_error(exc)
    if mapped is not None:
        return mapped
    if isinstance(exc, HTTPException):
        status = exc.status_code
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(
            status, "invalid_request" if status < 500 else "server_error")
        message = str(exc.detail) if status < 500 else "internal server error"
        if status == 413:
            message = "request body too large"
        return ApiError(message, code=code, status=status)
    log.error("unhandled error", exc_info=exc)
    return ApiError("internal server error", code="internal_error", status=500)


def _state_layer_error(exc: BaseException) -> ApiError | None:
    from appliance.auth import AuthError
    from appliance.db import STORAGE_CODE, StateError, storage_failure
    from appliance.usage import RateLimited

    if isinstance(exc, AuthError | StateError):
        return ApiError(exc.message, code=exc.code, status=exc.status)
    if isinstance(exc, RateLimited):
        return ApiError(exc.message, code=exc.code, status=429,
                        retry_after_s=exc.retry_after_s)
    reason = storage_failure(exc)
    if reason is not None:  # the operator's log says what; the client, only that it failed
        log.error("the database failed: %s (%s: %s)", reason, type(exc).__name__, exc)
        return ApiError("the server's storage is unavailable; try again later",
                        code=STORAGE_CODE, status=503, retry_after_s=STORAGE_RETRY_S)
    return None


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": _TYPES.get(err.status, "api_error"),
                      "param": err.param, "code": err.code}}


def error_headers(err: ApiError) -> dict[str, str]:
    headers = {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after_s)))
    if err.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_response(err: ApiError) -> Response[dict[str, Any]]:
    return Response(error_body(err), status_code=err.status, headers=error_headers(err))


def exception_hook(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    """Litestar's exception handler for every exception type."""
    err = as_api_error(exc)
    # The path only: a query string or header could carry a key.
    log.log(logging.WARNING if err.status >= 500 else logging.DEBUG, "%s %s -> %d %s",
            request.method, request.scope.get("path", ""), err.status, err.code)
    return error_response(err)
