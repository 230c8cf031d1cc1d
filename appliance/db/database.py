"""The SQLite database: one engine per process, WAL, synchronous=FULL, foreign keys on.

Every pooled connection gets its pragmas from the `connect` listener. The driver's own
transaction handling is switched off (isolation_level=None) and the `begin` listener emits
BEGIN itself, so a write session can start with BEGIN IMMEDIATE: it takes the write lock
up front and waits on the busy timeout, instead of failing with SQLITE_BUSY when another
process commits between its first read and its first write.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger(__name__)

BUSY_TIMEOUT_S = 30.0
_BEGIN_MODES = {"DEFERRED", "IMMEDIATE", "EXCLUSIVE"}


def _switch_to_wal(cursor: Any, timeout_s: float) -> str:
    """`PRAGMA journal_mode=WAL`, retried: on a fresh file the switch needs an exclusive
    lock and SQLite answers "database is locked" at once, without the busy handler, when
    another connection is switching or reading at that moment. WAL is persistent, so once
    one connection has switched the others find it done."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        try:
            return cursor.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def _set_pragmas(dbapi_connection: Any, busy_timeout_s: float) -> None:
    dbapi_connection.isolation_level = None  # BEGIN comes from _on_begin
    cursor = dbapi_connection.cursor()
    try:
        mode = _switch_to_wal(cursor, busy_timeout_s)
        if str(mode).lower() != "wal":
            log.warning("SQLite refused WAL mode (journal_mode=%s)", mode)
        cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def _on_begin(conn: Connection) -> None:
    mode = str(conn.get_execution_options().get("sqlite_begin", "DEFERRED")).upper()
    if mode not in _BEGIN_MODES:
        raise ValueError(f"sqlite_begin must be one of {sorted(_BEGIN_MODES)}, got {mode}")
    conn.exec_driver_sql(f"BEGIN {mode}")


def create_sqlite_engine(path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> Engine:
    # hide_parameters: statement errors must not echo bound values into logs or messages.
    engine = create_engine(
        f"sqlite:///{path}", hide_parameters=True,
        connect_args={"timeout": busy_timeout_s, "check_same_thread": False})

    def on_connect(dbapi_connection: Any, connection_record: Any) -> None:
        _set_pragmas(dbapi_connection, busy_timeout_s)

    event.listen(engine, "connect", on_connect)
    event.listen(engine, "begin", _on_begin)
    return engine


class Database:
    """The appliance database. `session()` is one transaction: committed when the block
    ends normally, rolled back when it raises. Thread-safe; sessions are not shared."""

    def __init__(self, path: Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.path = Path(path)
        self.engine = create_sqlite_engine(self.path, busy_timeout_s=busy_timeout_s)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self, *, write: bool = False) -> Iterator[Session]:
        """`write=True` begins with BEGIN IMMEDIATE (take the write lock first); use it for
        any transaction that reads and then writes."""
        with self._sessions() as session, session.begin():
            if write:
                session.connection(execution_options={"sqlite_begin": "IMMEDIATE"})
            yield session

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Database({str(self.path)!r})"
