"""Sliding windows of one key: requests and tokens over the last minute, tokens over the
last day. Times come from the limiter's monotonic clock, in seconds.

The minute windows keep one event per request (at most the key's traffic of one minute).
The day window keeps one bucket per minute (at most 1,440), so a day of traffic costs
bounded memory; a bucket leaves the window when its start is a day old, up to a minute
early.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MINUTE_S = 60.0
DAY_S = 86_400.0
BUCKET_S = 60.0


@dataclass(slots=True)
class KeyWindows:
    requests: deque[float] = field(default_factory=deque)  # admission times
    minute: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens)
    minute_tokens: int = 0
    day: deque[list[float]] = field(default_factory=deque)  # [bucket start, tokens]
    day_tokens: int = 0

    def expire(self, now: float) -> None:
        while self.requests and self.requests[0] + MINUTE_S <= now:
            self.requests.popleft()
        while self.minute and self.minute[0][0] + MINUTE_S <= now:
            self.minute_tokens -= self.minute.popleft()[1]
        while self.day and self.day[0][0] + DAY_S <= now:
            self.day_tokens -= int(self.day.popleft()[1])

    def add_tokens(self, now: float, tokens: int) -> None:
        if tokens <= 0:
            return
        self.minute.append((now, tokens))
        self.minute_tokens += tokens
        start = now - now % BUCKET_S
        if self.day and self.day[-1][0] == start:
            self.day[-1][1] += tokens
        elif self.day and self.day[-1][0] > start:  # seeded out of order: keep the order
            self.day[-1][1] += tokens
        else:
            self.day.append([start, tokens])
        self.day_tokens += tokens

    def request_wait(self, now: float, limit: int) -> float | None:
        """Seconds until one more request fits under `limit` per minute; None if it fits."""
        if len(self.requests) < limit:
            return None
        return self.requests[len(self.requests) - limit] + MINUTE_S - now

    def minute_token_wait(self, now: float, limit: int, tokens: int) -> float | None:
        return _wait(now, self.minute, self.minute_tokens, limit, tokens, MINUTE_S)

    def day_token_wait(self, now: float, limit: int, tokens: int) -> float | None:
        return _wait(now, self.day, self.day_tokens, limit, tokens, DAY_S)


def _wait(now: float, events: deque, used: int, limit: int, tokens: int,
          window_s: float) -> float | None:
    """Seconds until `tokens` more fit under `limit` (the oldest events leave first);
    None if they fit now. A request larger than the limit waits a whole window."""
    tokens = max(tokens, 1)
    excess = used + tokens - limit
    if excess <= 0:
        return None
    if tokens > limit:
        return window_s
    freed = 0
    for start, amount in events:
        freed += int(amount)
        if freed >= excess:
            return max(start + window_s - now, 0.0)
    return window_s
