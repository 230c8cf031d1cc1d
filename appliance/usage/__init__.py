"""Usage: per-key rate limits in memory, usage rows in SQLite, summaries for the admin API."""

from __future__ import annotations

from appliance.usage.limiter import RateLimited, RateLimiter
from appliance.usage.service import UsageService

__all__ = ["RateLimited", "RateLimiter", "UsageService"]
