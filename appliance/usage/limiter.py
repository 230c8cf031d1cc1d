"""RateLimiter: per-key requests/min, tokens/min and tokens/day over sliding windows.

check_request() runs before a request is admitted: it refuses if one more request, or
`estimated_tokens` more tokens, would pass a limit, and counts the admitted request.
Tokens are counted when record() reports what the request used (prompt + completion;
cached tokens are part of the prompt), so a request in flight is judged by the estimate
of the next one only. The day window is seeded from the usage table at start, so a
restart does not hand every key a fresh day.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import func, select

from appliance.auth import Principal
from appliance.db import Database
from appliance.db.models import UsageRecord
from appliance.db.types import utcnow
from appliance.usage.windows import DAY_S, KeyWindows
from appliance.usage.writer import UsageWriter

log = logging.getLogger(__name__)


class RateLimited(Exception):
    """429: a key is over a rate limit; retry after `retry_after_s` seconds."""

    status = 429

    def __init__(self, retry_after_s: float, message: str,
                 code: str = "rate_limit_exceeded") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code
        self.message = message


class RateLimiter:
    def __init__(self, db: Database | None = None,
                 clock: Callable[[], float] = time.monotonic, *,
                 now: Callable[[], datetime] = utcnow, flush_interval_s: float = 0.05) -> None:
        self._clock = clock
        self._now = now
        self._lock = threading.Lock()
        self._keys: dict[str, KeyWindows] = {}
        self._writer = UsageWriter(db, flush_interval_s=flush_interval_s) if db else None
        if db is not None:
            self._seed(db)

    def check_request(self, principal: Principal, estimated_tokens: int) -> None:
        q = principal.quota
        now = self._clock()
        with self._lock:
            w = self._windows(principal.key_id, now)
            if q.requests_per_min is not None:
                wait = w.request_wait(now, q.requests_per_min)
                if wait is not None:
                    raise RateLimited(wait, f"requests_per_min limit of {q.requests_per_min} "
                                            f"reached for key {principal.key_id}")
            for limit, label, check in (
                    (q.tokens_per_min, "tokens_per_min", w.minute_token_wait),
                    (q.tokens_per_day, "tokens_per_day", w.day_token_wait)):
                if limit is None:
                    continue
                wait = check(now, limit, estimated_tokens)
                if wait is not None:
                    raise RateLimited(wait, f"{label} limit of {limit} reached for key "
                                            f"{principal.key_id} (this request: about "
                                            f"{estimated_tokens} tokens)")
            if q.requests_per_min is not None:
                w.requests.append(now)

    def record(self, principal: Principal, model: str, prompt_tokens: int,
               completion_tokens: int, cached_tokens: int, status: str) -> None:
        now = self._clock()
        with self._lock:
            self._windows(principal.key_id, now).add_tokens(now, prompt_tokens + completion_tokens)
        if self._writer is not None:
            self._writer.add({
                "key_id": principal.key_id, "model": model, "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens, "cached_tokens": cached_tokens,
                "status": status, "created_at": self._now()})

    def usage(self, key_id: str) -> dict[str, int]:
        """The key's current window totals (for the dashboard and tests)."""
        now = self._clock()
        with self._lock:
            w = self._windows(key_id, now)
            return {"requests_last_min": len(w.requests), "tokens_last_min": w.minute_tokens,
                    "tokens_last_day": w.day_tokens}

    def flush(self) -> bool:
        return True if self._writer is None else self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()

    def _windows(self, key_id: str, now: float) -> KeyWindows:
        w = self._keys.get(key_id)
        if w is None:
            w = self._keys[key_id] = KeyWindows()
        w.expire(now)
        return w

    def _seed(self, db: Database) -> None:
        """Tokens per key and minute over the last day, placed on the monotonic clock at
        the age of each minute's newest row (so they stay counted up to a minute longer,
        never shorter)."""
        wall, mono = self._now(), self._clock()
        minute = func.substr(UsageRecord.created_at, 1, 16)  # 'YYYY-MM-DD HH:MM'
        newest = func.max(UsageRecord.created_at)
        query = (select(UsageRecord.key_id, newest,
                        func.sum(UsageRecord.prompt_tokens + UsageRecord.completion_tokens))
                 .where(UsageRecord.created_at >= wall - timedelta(seconds=DAY_S))
                 .group_by(UsageRecord.key_id, minute).order_by(newest))
        with db.session() as session:
            rows = session.execute(query).all()
        for key_id, at, tokens in rows:
            age = max((wall - at).total_seconds(), 0.0)
            self._keys.setdefault(key_id, KeyWindows()).add_tokens(mono - age, int(tokens or 0))
        for w in self._keys.values():
            w.expire(mono)
        log.debug("rate limiter seeded from %d usage buckets", len(rows))
