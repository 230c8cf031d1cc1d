"""The one exception hook: every engine error class maps to a 4xx/503 with its code;
anything unexpected is a 500 that names nothing internal."""

from __future__ import annotations

import inspect

from appliance.server.errors import as_api_error, error_body, error_headers
from engine import errors as engine_errors

EXPECTED = {"client_quota": 429, "overloaded": 503, "model_not_found": 404,
            "engine_error": 503}


def test_every_engine_error_maps_to_its_status_and_code():
    classes = [c for _, c in inspect.getmembers(engine_errors, inspect.isclass)
               if issubclass(c, engine_errors.EngineError)]
    assert len(classes) >= 10
    for cls in classes:
        err = as_api_error(cls("details with numbers 12 > 10"))
        assert err.code == cls.code
        assert err.status == EXPECTED.get(cls.code, 400), cls
        body = error_body(err)["error"]
        assert body["message"] == "details with numbers 12 > 10" and body["code"] == cls.code
        assert ("Retry-After" in error_headers(err)) == (err.status in (429, 503))


def test_unexpected_errors_hide_their_details():
    err = as_api_error(KeyError("/secret/path and mbufo_abcdefghij_x"))
    assert err.status == 500 and err.code == "internal_error"
    assert error_body(err)["error"]["message"] == "internal server error"
