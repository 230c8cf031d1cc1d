"""The database's storage failing (a full disk, a size limit, a read-only or damaged file):
`storage_failure` names it, the CLI ends with one line instead of a traceback, and the
database keeps what it had."""

from __future__ import annotations

import errno
import os
import resource
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from appliance.db import storage_failure

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("text,reason", [
    ("database or disk is full", "the disk is full"),
    ("disk I/O error", "disk I/O error"),
    ("attempt to write a readonly database", "read-only"),
    ("database disk image is malformed", "damaged"),
    ("database is locked", "lock"),
])
def test_sqlite_failures_are_named_through_sqlalchemy_and_causes(text, reason):
    raw = sqlite3.OperationalError(text)
    wrapped = OperationalError("INSERT INTO api_keys ...", {}, raw)
    assert reason in storage_failure(raw)
    assert reason in storage_failure(wrapped)
    try:
        try:
            raise wrapped
        except OperationalError as exc:
            raise RuntimeError("while creating a key") from exc
    except RuntimeError as outer:
        assert reason in storage_failure(outer)


def test_other_errors_are_not_storage_failures():
    assert storage_failure(OSError(errno.ENOSPC, "No space left on device")) == \
        "the disk is full"
    assert storage_failure(ValueError("bad quota")) is None
    assert storage_failure(OSError(errno.ENOENT, "missing")) is None
    assert storage_failure(sqlite3.OperationalError("no such table: api_keys")) is None
    assert storage_failure(IntegrityError("INSERT", {}, sqlite3.IntegrityError(
        "UNIQUE constraint failed: users.name"))) is None


def _mbufo(data_dir: Path, *argv: str, file_limit: int | None = None):
    def limit() -> None:  # in the child: writes past `file_limit` bytes fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    env = {**os.environ, "MBUFO_DATA_DIR": str(data_dir), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("MBUFO_CONFIG", None)
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=limit if file_limit is not None else None)


def test_a_write_past_the_file_size_limit_is_one_line_and_loses_nothing(tmp_path):
    """A real failing write: the child may write no file past 1 KiB (RLIMIT_FSIZE, as a
    full disk refuses), so SQLite's write of a new key fails. The command ends with status 2
    and one line naming the database, what failed and what to do; afterwards the database
    holds the keys it held, intact."""
    data = tmp_path / "data"
    first = _mbufo(data, "keys", "create", "--name", "first", "--role", "admin")
    assert first.returncode == 0, first.stderr
    failed = _mbufo(data, "keys", "create", "--name", "second", "--role", "user",
                    file_limit=1024)
    assert failed.returncode == 2, failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert "Traceback" not in failed.stderr and len(lines) == 1, failed.stderr
    assert lines[0].startswith("mbufo: error (storage_unavailable): the database at ")
    assert str(data / "mbufo.db") in lines[0] and "run it again" in lines[0]
    listing = _mbufo(data, "keys", "list", "--json")
    assert listing.returncode == 0, listing.stderr
    assert '"first"' in listing.stdout and '"second"' not in listing.stdout
    with sqlite3.connect(data / "mbufo.db") as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
