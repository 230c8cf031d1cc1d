"""UsageService: totals per key and model for the admin API and the dashboard."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select

from appliance.db import Database
from appliance.db.models import ApiKey, UsageRecord, User


class UsageService:
    def __init__(self, db: Database) -> None:
        self._db = db

    def summary(self, since: datetime | None = None,
                key_id: str | None = None) -> list[dict[str, Any]]:
        """One dict per (key, model): requests, token sums, a count per status, the first
        and last request (ISO 8601), the key's user (None for a key no row holds)."""
        u = UsageRecord
        where = []
        if since is not None:
            where.append(u.created_at >= since)
        if key_id is not None:
            where.append(u.key_id == key_id)
        totals = (select(u.key_id, u.model, User.name, func.count(),
                         func.sum(u.prompt_tokens), func.sum(u.completion_tokens),
                         func.sum(u.cached_tokens), func.min(u.created_at),
                         func.max(u.created_at))
                  .outerjoin(ApiKey, ApiKey.id == u.key_id)
                  .outerjoin(User, User.id == ApiKey.user_id)
                  .where(*where).group_by(u.key_id, u.model).order_by(u.key_id, u.model))
        statuses = (select(u.key_id, u.model, u.status, func.count()).where(*where)
                    .group_by(u.key_id, u.model, u.status))
        with self._db.session() as session:
            rows = session.execute(totals).all()
            counts: dict[tuple[str, str], dict[str, int]] = {}
            for key, model, status, n in session.execute(statuses):
                counts.setdefault((key, model), {})[status] = n
        out = []
        for key, model, user, n, prompt, completion, cached, first, last in rows:
            out.append({
                "key_id": key, "user": user, "model": model, "requests": n,
                "prompt_tokens": int(prompt or 0), "completion_tokens": int(completion or 0),
                "cached_tokens": int(cached or 0),
                "total_tokens": int(prompt or 0) + int(completion or 0),
                "statuses": counts.get((key, model), {}),
                "first_at": first.isoformat(), "last_at": last.isoformat()})
        return out
