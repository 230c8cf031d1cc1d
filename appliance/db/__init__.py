"""The appliance's state: one SQLite database, opened (and migrated to head) by
`open_database`. Services own sessions and rules; `appliance.db.models` holds columns."""

from __future__ import annotations

import logging
import os

from appliance.db.database import Database
from appliance.db.errors import STORAGE_CODE, StateError, storage_failure
from appliance.settings import Settings

log = logging.getLogger(__name__)

__all__ = ["STORAGE_CODE", "Database", "StateError", "open_database", "storage_failure"]


def open_database(settings: Settings, *, upgrade: bool = True) -> Database:
    """Open `settings.database_path`, creating the data directory (mode 0700) and the file
    (0600) when missing, and bring the schema to head unless `upgrade` is False."""
    data_dir = settings.data_dir
    if not data_dir.exists():
        data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(data_dir, 0o700)  # mkdir's mode is filtered by the umask
        log.info("created data directory %s", data_dir)
    path = settings.database_path
    if not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    db = Database(path)
    if upgrade:
        from appliance.db.migrate import ensure_head

        try:
            ensure_head(db)
        except BaseException:
            db.close()
            raise
    return db
