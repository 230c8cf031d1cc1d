"""Schema: Alembic from empty to head, down to base and up again; the ORM and the
migrations agree; connection pragmas; files and modes; locking between writers."""

from __future__ import annotations

import logging
import sqlite3
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import main as alembic_main
from alembic.runtime.migration import MigrationContext

from appliance.db import Database, StateError, migrate, open_database
from appliance.db.database import _switch_to_wal
from appliance.db.models import Base
from appliance.settings import Settings

TABLES = {"models", "users", "api_keys", "quotas", "usage", "settings"}
MIGRATIONS = Path(__file__).resolve().parents[3] / "migrations"


def tables(path: Path) -> set[str]:
    with sqlite3.connect(path) as conn:  # the stdlib driver, not our engine
        rows = conn.execute("SELECT name FROM sqlite_master WHERE type='table'").fetchall()
    return {r[0] for r in rows} - {"sqlite_sequence"}


def test_empty_to_head_to_base_to_head(tmp_path: Path) -> None:
    data_dir = tmp_path / "fresh" / "data"
    db = open_database(Settings(data_dir=data_dir))
    try:
        head = migrate.head_revision()
        assert migrate.current_revision(db) == head
        assert tables(db.path) == TABLES | {"alembic_version"}
        migrate.downgrade(db, "base")
        assert migrate.current_revision(db) is None
        assert tables(db.path) == {"alembic_version"}
        migrate.upgrade(db, "head")
        assert migrate.current_revision(db) == head
        assert tables(db.path) == TABLES | {"alembic_version"}
    finally:
        db.close()


def test_orm_models_match_the_migrations(db: Database) -> None:
    with db.engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True})
        assert compare_metadata(context, Base.metadata) == []


def test_every_connection_has_wal_full_sync_and_foreign_keys(db: Database) -> None:
    conns = [db.engine.connect() for _ in range(3)]  # three distinct pooled connections
    try:
        for conn in conns:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            conn.rollback()
    finally:
        for conn in conns:
            conn.close()


def test_foreign_keys_are_enforced(db: Database) -> None:
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError), db.session() as session:
        session.execute(Base.metadata.tables["quotas"].insert().values(key_id="nokey"))


def test_data_dir_0700_and_database_0600(tmp_path: Path) -> None:
    data_dir = tmp_path / "a" / "b"
    open_database(Settings(data_dir=data_dir)).close()
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((data_dir / "mbufo.db").stat().st_mode) == 0o600


def test_write_session_takes_the_write_lock_first(db: Database) -> None:
    other = sqlite3.connect(db.path, timeout=0, isolation_level=None)
    try:
        with db.session(write=True):
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")  # free again after the commit
        other.execute("ROLLBACK")
    finally:
        other.close()


def test_migration_takes_the_write_lock_first(db: Database) -> None:
    """A migration's transaction holds the write lock from its first statement (a read),
    so no other connection can commit between its reads and its writes."""
    other = sqlite3.connect(db.path, timeout=0, isolation_level=None)
    try:
        with migrate.migration_connection(db) as conn:
            conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar()
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        other.execute("BEGIN IMMEDIATE")  # free again once it is over
        other.execute("ROLLBACK")
    finally:
        other.close()


def test_concurrent_first_opens_migrate_once(tmp_path: Path) -> None:
    # The WAL switch race hit about one round in sixteen before _switch_to_wal retried.
    for round_ in range(40):
        settings = Settings(data_dir=tmp_path / f"data{round_}")
        errors: list[BaseException] = []

        def opener(settings: Settings = settings, errors: list = errors) -> None:
            try:
                open_database(settings).close()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=opener) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [], f"round {round_}"
        with sqlite3.connect(settings.database_path) as conn:
            assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [
                (migrate.head_revision(),)]


class _LockedCursor:
    """Answers "database is locked" to the WAL switch `fails` times, then "wal"."""

    def __init__(self, fails: int, message: str = "database is locked") -> None:
        self.fails, self.message, self.calls = fails, message, 0

    def execute(self, sql: str) -> _LockedCursor:
        assert sql == "PRAGMA journal_mode=WAL"
        self.calls += 1
        if self.calls <= self.fails:
            raise sqlite3.OperationalError(self.message)
        return self

    def fetchone(self) -> tuple[str]:
        return ("wal",)


def test_wal_switch_retries_while_locked() -> None:
    cursor = _LockedCursor(fails=3)
    assert _switch_to_wal(cursor, timeout_s=5.0) == "wal"
    assert cursor.calls == 4


def test_wal_switch_gives_up_at_the_timeout_and_on_other_errors() -> None:
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        _switch_to_wal(_LockedCursor(fails=10**6), timeout_s=0.05)
    cursor = _LockedCursor(fails=1, message="disk I/O error")
    with pytest.raises(sqlite3.OperationalError, match="disk"):
        _switch_to_wal(cursor, timeout_s=5.0)
    assert cursor.calls == 1


def test_database_from_a_newer_version_is_refused(db: Database, settings: Settings) -> None:
    with db.session() as session:
        session.connection().exec_driver_sql("UPDATE alembic_version SET version_num='9999'")
    with pytest.raises(StateError, match="9999") as info:
        open_database(settings)
    assert info.value.code == "database_revision"


def test_unknown_revision_is_a_state_error(db: Database) -> None:
    with pytest.raises(StateError) as info:
        migrate.downgrade(db, "nonexistent")
    assert info.value.code == "bad_revision"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    # alembic.ini's logging sections reconfigure the root logger of this process
    root, alembic_log = logging.getLogger(), logging.getLogger("alembic")
    saved = (root.level, root.handlers[:], alembic_log.level, alembic_log.handlers[:])
    yield
    root.setLevel(saved[0])
    root.handlers[:] = saved[1]
    alembic_log.setLevel(saved[2])
    alembic_log.handlers[:] = saved[3]


def test_alembic_command_line_uses_the_same_environment(tmp_path: Path,
                                                         restore_logging: None) -> None:
    path = tmp_path / "cli.db"
    ini = str(MIGRATIONS / "alembic.ini")
    alembic_main(["-c", ini, "-x", f"db={path}", "upgrade", "head"])
    assert tables(path) == TABLES | {"alembic_version"}
    alembic_main(["-c", ini, "-x", f"db={path}", "downgrade", "base"])
    assert tables(path) == {"alembic_version"}
