"""Alembic, driven from code: `open_database` brings a database to head, `mbufo db` moves it.

Migrations run on one connection with foreign keys off (batch mode on SQLite copies and
drops tables; with foreign keys on, dropping a parent table would cascade-delete its
children), check `PRAGMA foreign_key_check` before committing, and the connection is then
discarded so no pooled connection keeps foreign keys off. A file lock serializes processes
that open the same fresh database at once (the server and a CLI command).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection

from appliance.db.database import Database
from appliance.db.errors import StateError

log = logging.getLogger(__name__)

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(connection: Connection | None = None):  # -> alembic.config.Config
    from alembic.config import Config

    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise StateError(f"database migrations not found in {MIGRATIONS_DIR}",
                         status=500, code="migrations_missing")
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the migrations directory has no revisions"
    return head


def known_revisions() -> set[str]:
    from alembic.script import ScriptDirectory

    return {s.revision for s in ScriptDirectory.from_config(alembic_config()).walk_revisions()}


def current_revision(db: Database) -> str | None:
    # Read the version table directly: MigrationContext would log on every open.
    with db.engine.connect() as conn:
        if not conn.exec_driver_sql(
                "SELECT 1 FROM sqlite_master WHERE type='table' AND name='alembic_version'"
        ).first():
            return None
        return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()


@contextmanager
def migration_connection(db: Database) -> Iterator[Connection]:
    """A connection with foreign keys off, holding the migration lock; discarded after.
    Its transactions begin IMMEDIATE: a migration reads (is the version table there?)
    before it writes, and a deferred transaction that another connection's commit or lock
    overtakes between the two fails at once with "database is locked" instead of waiting
    (seen with four threads opening one fresh database under load)."""
    with _file_lock(db.path), db.engine.connect() as conn:
        conn.connection.dbapi_connection.execute("PRAGMA foreign_keys=OFF")  # outside a txn
        conn.execution_options(sqlite_begin="IMMEDIATE")
        try:
            yield conn
            bad = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
            conn.rollback()
            if bad:
                raise StateError(f"migration left {len(bad)} broken foreign key(s): {bad[:5]}",
                                 status=500, code="migration_failed")
        finally:
            conn.invalidate()


def upgrade(db: Database, revision: str = "head") -> None:
    _run(db, "upgrade", revision)


def downgrade(db: Database, revision: str) -> None:
    _run(db, "downgrade", revision)


def ensure_head(db: Database) -> None:
    """Upgrade to head if needed; refuse a database written by a newer mbufo."""
    current, head = current_revision(db), head_revision()
    if current == head:
        return
    if current is not None and current not in known_revisions():
        raise StateError(f"{db.path} is at schema revision {current}, which this version of "
                         f"mbufo does not know (written by a newer version?)",
                         status=500, code="database_revision")
    upgrade(db, "head")


def _run(db: Database, direction: str, revision: str) -> None:
    from alembic import command
    from alembic.util.exc import CommandError

    action: Callable[..., None] = getattr(command, direction)
    before = current_revision(db)
    with migration_connection(db) as conn:
        try:
            action(alembic_config(conn), revision)
        except CommandError as exc:
            raise StateError(f"cannot {direction} to {revision!r}: {exc}",
                             code="bad_revision") from exc
    log.info("database %s: %s %s -> %s", db.path, direction, before, current_revision(db))


@contextmanager
def _file_lock(db_path: Path) -> Iterator[None]:
    fd = os.open(f"{db_path}.migrate-lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
