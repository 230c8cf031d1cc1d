"""Buffered usage rows: record() appends, a thread writes batches, close() flushes.

Each batch is one transaction, so a row is written whole or not at all. The thread writes
what has gathered every `flush_interval_s` (50 ms: a killed server loses at most that
much usage; a busy one commits about 20 batches a second, whatever its request rate). A
failed batch goes back to the head of the buffer; while the database keeps refusing (a
full disk), the retries back off to RETRY_MAX_S and only the first failure and the
recovery are logged. Past MAX_BUFFERED rows the oldest are dropped (and logged) rather
than growing without bound while the disk is unwritable.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from sqlalchemy import insert
from sqlalchemy.exc import SQLAlchemyError

from appliance.db import Database
from appliance.db.models import UsageRecord

log = logging.getLogger(__name__)

MAX_BUFFERED = 100_000
BATCH_ROWS = 256
RETRY_MAX_S = 10.0


class UsageWriter:
    def __init__(self, db: Database, *, flush_interval_s: float = 0.05) -> None:
        self._db = db
        self._interval = flush_interval_s
        self._failing = False  # the last flush was refused
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one batch in flight at a time, in order
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
        self._thread.start()

    def add(self, row: dict[str, Any]) -> None:
        with self._lock:
            self._rows.append(row)
            if len(self._rows) > MAX_BUFFERED:
                del self._rows[: len(self._rows) - MAX_BUFFERED]
                log.error("usage buffer full: dropped the oldest rows")
            if len(self._rows) >= BATCH_ROWS:
                self._wake.set()
        if self._stopping:  # recorded after close(): no thread left to write it
            self.flush()

    def flush(self) -> bool:
        """Write everything buffered now; False (rows kept) if the database refused."""
        with self._flush_lock:
            with self._lock:
                rows, self._rows = self._rows, []
            if not rows:
                return True
            try:
                with self._db.session() as session:
                    session.execute(insert(UsageRecord), rows)
            except SQLAlchemyError as exc:
                log.log(logging.DEBUG if self._failing else logging.WARNING,
                        "could not write %d usage rows (kept for retry): %s", len(rows),
                        getattr(exc, "orig", exc))
                self._failing = True
                with self._lock:
                    self._rows[:0] = rows
                return False
            if self._failing:
                self._failing = False
                log.info("usage rows written again (%d waited)", len(rows))
            return True

    def close(self) -> None:
        if not self._stopping:
            self._stopping = True
            self._wake.set()
            self._thread.join()
        self.flush()

    def _run(self) -> None:
        wait = self._interval
        while not self._stopping:
            self._wake.wait(wait)
            self._wake.clear()
            wait = self._interval if self.flush() else min(max(2 * wait, 0.5), RETRY_MAX_S)
