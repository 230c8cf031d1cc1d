"""The error the state services raise for bad input or a missing/conflicting row, and the
test for the database's storage failing under them (`storage_failure`).

StateError carries an HTTP `status` and a machine `code` like AuthError and RateLimited,
so one exception hook can map all of them to OpenAI-shaped JSON. A failing store (a full
disk, say) surfaces as the driver's own error from anywhere; the CLI and the server's
hook ask `storage_failure` and answer it as `storage_unavailable` instead of a traceback
or a bare 500."""

from __future__ import annotations

import errno
import sqlite3


class StateError(ValueError):
    """Invalid argument (400 invalid_request), unknown row (404 not_found), duplicate (409)."""

    def __init__(self, message: str, *, status: int = 400, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


STORAGE_CODE = "storage_unavailable"
# SQLite's messages for a failing store (sqlite3 exceptions carry only the text) -> what
# to tell the operator.
_SQLITE_FAILURES = (
    ("database or disk is full", "the disk is full"),
    ("disk i/o error", "a disk I/O error (a full disk, a size limit or a failing device)"),
    ("readonly database", "the database is read-only"),
    ("unable to open database file", "the database file cannot be opened"),
    ("database disk image is malformed", "the database file is damaged"),
    ("file is not a database", "the database file is not an SQLite database"),
    ("database is locked", "another process holds the database's lock"),
)
_OS_FAILURES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                errno.EFBIG: "the file size limit is reached",
                errno.EROFS: "the file system is read-only", errno.EIO: "a disk I/O error"}


def storage_failure(exc: BaseException) -> str | None:
    """What failed, when `exc` (or an error it wraps: SQLAlchemy's `orig`, a cause) is the
    database's storage failing: full, read-only, damaged, I/O errors, a lock held past the
    busy timeout. None for any other error."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, sqlite3.Error):
            text = str(e).lower()
            for needle, reason in _SQLITE_FAILURES:
                if needle in text:
                    return reason
        elif isinstance(e, OSError) and e.errno in _OS_FAILURES:
            return _OS_FAILURES[e.errno]
        todo += [getattr(e, "orig", None), e.__cause__, e.__context__]
    return None
