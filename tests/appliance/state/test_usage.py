"""Rate limiter windows on a fake clock, usage rows written whole, seeding from the usage
table, summaries. Expected waits are worked out by hand from the window definitions."""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from appliance.auth import Principal, Quota
from appliance.db import Database
from appliance.usage import RateLimited, RateLimiter, UsageService


def who(key_id: str = "k1", **limits: int) -> Principal:
    return Principal(key_id=key_id, user="u", role="user", quota=Quota(**limits))


def test_requests_per_minute_slides(clock) -> None:
    limiter, p = RateLimiter(clock=clock), who(requests_per_min=3)
    for t in (0.0, 10.0, 20.0):
        clock.now = t
        limiter.check_request(p, 1)
    clock.now = 30.0
    with pytest.raises(RateLimited) as err:
        limiter.check_request(p, 1)
    assert err.value.retry_after_s == pytest.approx(30.0)  # the t=0 request leaves at 60
    assert err.value.code == "rate_limit_exceeded" and "requests_per_min" in err.value.message
    limiter.check_request(who("k2", requests_per_min=3), 1)  # other keys are not affected
    clock.now = 60.0
    limiter.check_request(p, 1)
    with pytest.raises(RateLimited) as err:
        limiter.check_request(p, 1)
    assert err.value.retry_after_s == pytest.approx(10.0)  # next to leave: t=10 at 70


def test_refused_requests_do_not_count(clock) -> None:
    limiter, p = RateLimiter(clock=clock), who(requests_per_min=1)
    limiter.check_request(p, 1)
    for _ in range(5):
        with pytest.raises(RateLimited):
            limiter.check_request(p, 1)
    clock.now = 60.0
    limiter.check_request(p, 1)


def test_tokens_per_minute(clock) -> None:
    limiter, p = RateLimiter(clock=clock), who(tokens_per_min=1000)
    for t in (0.0, 10.0, 20.0):
        clock.now = t
        limiter.record(p, "m", 250, 50, 100, "ok")  # 300 tokens each; cached is in prompt
    clock.now = 30.0
    limiter.check_request(p, 100)  # 900 + 100 fits exactly
    with pytest.raises(RateLimited) as err:
        limiter.check_request(p, 200)  # 1100: 100 over, freed when t=0 leaves at 60
    assert err.value.retry_after_s == pytest.approx(30.0)
    assert "tokens_per_min" in err.value.message
    with pytest.raises(RateLimited) as err:
        limiter.check_request(p, 500)  # 400 over: t=0 and t=10 must leave (at 70)
    assert err.value.retry_after_s == pytest.approx(40.0)
    with pytest.raises(RateLimited) as err:
        limiter.check_request(p, 1001)  # larger than the limit: a whole window
    assert err.value.retry_after_s == pytest.approx(60.0)
    clock.now = 60.0
    limiter.check_request(p, 400)  # t=0 has left: 600 + 400
    assert limiter.usage("k1")["tokens_last_min"] == 600


def test_tokens_per_day(clock) -> None:
    limiter, p = RateLimiter(clock=clock), who(tokens_per_day=10_000)
    limiter.record(p, "m", 9_000, 0, 0, "ok")
    clock.now = 3_600.0
    limiter.check_request(p, 1_000)
    with pytest.raises(RateLimited) as err:
        limiter.check_request(p, 2_000)
    assert err.value.retry_after_s == pytest.approx(86_400 - 3_600)
    assert "tokens_per_day" in err.value.message
    clock.now = 86_400.0
    limiter.check_request(p, 10_000)
    assert limiter.usage("k1")["tokens_last_day"] == 0


def test_unlimited_keys_pass(clock) -> None:
    limiter, p = RateLimiter(clock=clock), who()
    for _ in range(1000):
        limiter.check_request(p, 10**9)
        limiter.record(p, "m", 10**6, 10**6, 0, "ok")


def test_limiter_is_thread_safe(clock) -> None:
    limiter, p = RateLimiter(clock=clock), who(requests_per_min=100)
    admitted: list[int] = []
    lock = threading.Lock()

    def worker() -> None:
        n = 0
        for _ in range(50):
            try:
                limiter.check_request(p, 1)
                n += 1
            except RateLimited:
                pass
        with lock:
            admitted.append(n)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted) == 100


def usage_rows(db: Database) -> list[tuple]:
    with sqlite3.connect(db.path) as conn:
        return conn.execute("SELECT key_id, model, prompt_tokens, completion_tokens, "
                            "cached_tokens, status FROM usage ORDER BY id").fetchall()


def test_record_writes_rows_flushed_on_close(db: Database) -> None:
    limiter = RateLimiter(db, flush_interval_s=3600)  # only close() flushes
    limiter.record(who("a"), "m1", 10, 5, 2, "ok")
    limiter.record(who("b"), "m2", 7, 0, 0, "error")
    assert usage_rows(db) == []
    limiter.close()
    assert usage_rows(db) == [("a", "m1", 10, 5, 2, "ok"), ("b", "m2", 7, 0, 0, "error")]


def test_the_writer_thread_flushes_by_itself(db: Database) -> None:
    limiter = RateLimiter(db, flush_interval_s=0.05)
    try:
        limiter.record(who("a"), "m1", 1, 2, 0, "ok")
        deadline = time.monotonic() + 5.0
        while not usage_rows(db) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert usage_rows(db) == [("a", "m1", 1, 2, 0, "ok")]
    finally:
        limiter.close()
    limiter.record(who("a"), "m1", 3, 4, 0, "ok")  # after close: written at once
    assert len(usage_rows(db)) == 2


def test_a_refused_batch_is_kept_whole_and_retried(settings) -> None:
    db = Database(settings.database_path, busy_timeout_s=0.05)
    limiter = RateLimiter(db, flush_interval_s=3600)
    blocker = sqlite3.connect(db.path, isolation_level=None)
    try:
        for i in range(5):
            limiter.record(who("a"), "m", i, 1, 0, "ok")
        blocker.execute("BEGIN IMMEDIATE")  # another writer holds the lock
        assert limiter.flush() is False
        blocker.execute("ROLLBACK")
        assert usage_rows(db) == []  # nothing half-written
        limiter.record(who("a"), "m", 99, 1, 0, "ok")
        assert limiter.flush() is True
        assert [r[2] for r in usage_rows(db)] == [0, 1, 2, 3, 4, 99]
    finally:
        blocker.close()
        limiter.close()
        db.close()


def test_a_refusing_database_is_retried_with_backoff_and_logged_once(settings, caplog):
    """While another writer holds the lock (as a full disk refuses), the thread keeps the
    rows and retries less and less often, warning once; the rows land after the release."""
    db = Database(settings.database_path, busy_timeout_s=0.02)
    limiter = RateLimiter(db, flush_interval_s=0.01)
    blocker = sqlite3.connect(db.path, isolation_level=None)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        with caplog.at_level(logging.DEBUG, logger="appliance.usage.writer"):
            for i in range(3):
                limiter.record(who("a"), "m", i, 1, 0, "ok")
            time.sleep(1.5)  # at 10 ms a try without backoff: over 40 refusals
            refusals = [r for r in caplog.records if "could not write" in r.message]
            assert 2 <= len(refusals) <= 5, len(refusals)
            assert [r.levelno for r in refusals].count(logging.WARNING) == 1
            blocker.execute("ROLLBACK")
            deadline = time.monotonic() + 15.0
            while len(usage_rows(db)) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert [r[2] for r in usage_rows(db)] == [0, 1, 2]
        assert any("written again" in r.message for r in caplog.records)
    finally:
        blocker.close()
        limiter.close()
        db.close()


def test_day_window_is_seeded_from_the_usage_table(db: Database, clock) -> None:
    wall = datetime(2030, 1, 2, 12, 0, tzinfo=UTC)
    with sqlite3.connect(db.path) as conn:
        def row(key: str, age: timedelta, tokens: int) -> None:
            at = (wall - age).replace(tzinfo=None).isoformat(sep=" ")
            conn.execute("INSERT INTO usage (key_id, model, prompt_tokens, completion_tokens,"
                         " cached_tokens, status, created_at) VALUES (?, 'm', ?, 0, 0, 'ok', ?)",
                         (key, tokens, at))
        row("a", timedelta(hours=2), 6_000)
        row("a", timedelta(seconds=30), 3_000)
        row("a", timedelta(days=2), 50_000)  # older than a day: not counted
        row("b", timedelta(hours=1), 1_000)
    clock.now = 1_000_000.0
    limiter = RateLimiter(db, clock=clock, now=lambda: wall)
    try:
        assert limiter.usage("a")["tokens_last_day"] == 9_000
        assert limiter.usage("a")["tokens_last_min"] == 3_000
        assert limiter.usage("b")["tokens_last_day"] == 1_000
        with pytest.raises(RateLimited):
            limiter.check_request(who("a", tokens_per_day=10_000), 2_000)
        limiter.check_request(who("b", tokens_per_day=10_000), 2_000)
    finally:
        limiter.close()


def test_usage_summary(db: Database) -> None:
    from appliance.auth import KeyService

    _, info = KeyService(db).create(name="laptop", user="alice", role="user")
    limiter = RateLimiter(db)
    p = who(info.key_id)
    limiter.record(p, "m1", 10, 5, 4, "ok")
    limiter.record(p, "m1", 20, 0, 0, "error")
    limiter.record(p, "m2", 1, 1, 0, "ok")
    limiter.record(who("local"), "m1", 3, 3, 0, "ok")
    limiter.close()
    rows = UsageService(db).summary()
    by = {(r["key_id"], r["model"]): r for r in rows}
    assert set(by) == {(info.key_id, "m1"), (info.key_id, "m2"), ("local", "m1")}
    m1 = by[(info.key_id, "m1")]
    assert (m1["requests"], m1["prompt_tokens"], m1["completion_tokens"],
            m1["cached_tokens"], m1["total_tokens"]) == (2, 30, 5, 4, 35)
    assert m1["statuses"] == {"ok": 1, "error": 1} and m1["user"] == "alice"
    assert by[("local", "m1")]["user"] is None
    assert [r["model"] for r in UsageService(db).summary(key_id="local")] == ["m1"]
    future = datetime.now(UTC) + timedelta(minutes=5)
    assert UsageService(db).summary(since=future) == []
