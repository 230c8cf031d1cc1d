"""Alembic environment for the appliance database (SQLite, batch mode for ALTERs).

From code (appliance/db/migrate.py) the connection arrives in `config.attributes`, already
holding the migration lock with foreign keys off. From the alembic command line the
database is `-x db=PATH`.
"""

from __future__ import annotations

from logging.config import fileConfig
from pathlib import Path

from alembic import context
from sqlalchemy import Connection

from appliance.db.models import Base

config = context.config
target_metadata = Base.metadata


def _db_path() -> Path:
    path = context.get_x_argument(as_dictionary=True).get("db")
    if not path:
        raise SystemExit("give the database: alembic -c migrations/alembic.ini -x db=PATH ...")
    return Path(path)


def _run(connection: Connection) -> None:
    # transactional_ddl: with BEGIN emitted by appliance.db.database, SQLite DDL is
    # transactional, so a failing upgrade leaves the schema where it started.
    context.configure(connection=connection, target_metadata=target_metadata,
                      render_as_batch=True, compare_type=True, transactional_ddl=True)
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(url=f"sqlite:///{_db_path()}", target_metadata=target_metadata,
                      literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from appliance.db.database import Database
    from appliance.db.migrate import migration_connection

    db = Database(_db_path())
    try:
        with migration_connection(db) as conn:
            _run(conn)
    finally:
        db.close()


if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    run_offline()
else:
    run_online()
