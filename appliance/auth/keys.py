"""The API key format: `mbufo_<id>_<secret>`.

id: 10 characters of [A-Za-z0-9] (public; the visible prefix and the row's primary key).
secret: 32 random bytes written as 43 base-62 digits (62**43 > 2**256). Both parts are
alphanumeric, so the key splits on '_' unambiguously, survives URLs and shells, and a
double click selects all of it. Only SHA-256(secret) is stored: the secret has 256 bits
of entropy, so a fast unsalted hash is enough (no dictionary to attack).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string

from appliance.auth.types import AuthError

PREFIX = "mbufo_"
ALPHABET = string.ascii_letters + string.digits  # 62 url-safe characters
ID_LENGTH = 10
SECRET_BYTES = 32
SECRET_LENGTH = 43
# ids of 8-12 and secrets of 43-128 characters are accepted, leaving room to change lengths
_KEY = re.compile(r"mbufo_([A-Za-z0-9]{8,12})_([A-Za-z0-9]{43,128})")
_BEARER = "bearer"
_OWS = " \t"  # HTTP's optional whitespace; anything else around the key is malformed


def new_key_id() -> str:
    return "".join(secrets.choice(ALPHABET) for _ in range(ID_LENGTH))


def new_secret() -> str:
    n = int.from_bytes(secrets.token_bytes(SECRET_BYTES), "big")
    digits = []
    for _ in range(SECRET_LENGTH):
        n, r = divmod(n, 62)
        digits.append(ALPHABET[r])
    assert n == 0
    return "".join(digits)


def format_key(key_id: str, secret: str) -> str:
    return f"{PREFIX}{key_id}_{secret}"


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def parse_key(token: str) -> tuple[str, str] | None:
    """(id, secret) of a well-formed key, else None."""
    match = _KEY.fullmatch(token)
    return (match.group(1), match.group(2)) if match else None


def parse_authorization(header: str | None) -> tuple[str, str]:
    """(id, secret) from an `Authorization: Bearer <key>` value, else AuthError 401."""
    if header is None or not header.strip(_OWS):
        raise AuthError(401, "invalid_api_key",
                        "missing API key: send 'Authorization: Bearer mbufo_...'")
    scheme, _, token = header.strip(_OWS).partition(" ")
    if scheme.lower() != _BEARER:
        raise AuthError(401, "invalid_api_key",
                        "malformed Authorization header: expected 'Bearer mbufo_...'")
    parsed = parse_key(token.strip(_OWS))
    if parsed is None:
        raise AuthError(401, "invalid_api_key", "malformed API key: expected mbufo_<id>_<secret>")
    return parsed
