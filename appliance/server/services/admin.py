"""The admin API's rules: models (registered, loaded, load, unload, add, remove), keys
(list, create, revoke, quota), usage summaries and each engine's live state.

Database work runs in worker threads (SQLite may wait on a lock; hashing a GGUF on
`add` reads the whole file), so the event loop keeps streaming while an admin acts.
"""

from __future__ import annotations

import asyncio
import dataclasses
from datetime import datetime
from typing import Any

from appliance.auth import Quota
from appliance.db.types import utcnow
from appliance.server.errors import NotFound
from appliance.server.schemas import AddModel, CreateKey, ModelRef, QuotaPatch

RECENT_ITL = 64  # inter-token gaps shown per model


class AdminService:
    def __init__(self, router: Any, registry: Any, keys: Any, usage: Any) -> None:
        self.router = router
        self.registry = registry
        self.keys = keys
        self.usage = usage

    # -- models --------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        registered = await asyncio.to_thread(self.registry.list) if self.registry else []
        loaded = self.router.handles()
        return {"default": loaded[0].name if loaded else None,
                "loaded": [h.describe() for h in loaded],
                "loading": [{"name": k, "source": v} for k, v in self.router.loading().items()],
                "registered": [r.to_dict() for r in registered],
                "memory": {"budget_bytes": self.router.budget_bytes,
                           "used_bytes": self.router.used_bytes()}}

    async def load(self, ref: ModelRef) -> dict[str, Any]:
        spec = await asyncio.to_thread(self.router.resolve, ref.name, sessions=ref.sessions,
                                       context=ref.context, kv_quant=ref.kv_quant)
        handle = await self.router.load(spec)
        return handle.describe()

    async def unload(self, name: str) -> dict[str, Any]:
        await self.router.unload(name)
        return {"name": name, "unloaded": True}

    async def add(self, body: AddModel) -> dict[str, Any]:
        record = await asyncio.to_thread(self.registry.add, body.path, name=body.name,
                                         sessions=body.sessions, context=body.context,
                                         kv_quant=body.kv_quant)
        return record.to_dict()

    async def remove(self, name: str) -> dict[str, Any]:
        if not await asyncio.to_thread(self.registry.remove, name):
            raise NotFound(f"no registered model named '{name}'", code="not_found")
        return {"name": name, "removed": True}

    # -- keys ----------------------------------------------------------------------------
    async def list_keys(self) -> dict[str, Any]:
        now = utcnow()
        return {"data": [k.to_dict(now) for k in await asyncio.to_thread(self.keys.list)]}

    async def create_key(self, body: CreateKey) -> dict[str, Any]:
        quota = Quota(**body.quota.fields()) if body.quota is not None else None
        key, info = await asyncio.to_thread(lambda: self.keys.create(
            name=body.name, user=body.user, role=body.role, quota=quota))
        return {"key": key, **info.to_dict(utcnow())}  # the only time the secret is shown

    async def revoke_key(self, key_id: str) -> dict[str, Any]:
        info = await asyncio.to_thread(self.keys.get, key_id)
        if info is None:
            raise NotFound(f"no API key with id {key_id}", code="not_found")
        revoked = await asyncio.to_thread(self.keys.revoke, key_id)
        return {"id": key_id, "revoked": True, "was_active": revoked}

    async def set_quota(self, key_id: str, patch: QuotaPatch) -> dict[str, Any]:
        info = await asyncio.to_thread(self.keys.get, key_id)
        if info is None:
            raise NotFound(f"no API key with id {key_id}", code="not_found")
        quota = dataclasses.replace(info.quota, **patch.fields())
        await asyncio.to_thread(self.keys.set_quota, key_id, quota)
        return {"id": key_id, "quota": quota.to_dict()}

    # -- usage and live state ------------------------------------------------------------
    async def usage_summary(self, since: datetime | None, key_id: str | None) -> dict[str, Any]:
        rows = await asyncio.to_thread(self.usage.summary, since, key_id)
        return {"data": rows}

    def state(self) -> dict[str, Any]:
        return {"models": [engine_state(h) for h in self.router.handles()]}


def engine_state(handle: Any) -> dict[str, Any]:
    """One model's EngineStats as JSON: sessions, KV pages per group, per-client queues."""
    stats = handle.engine.stats()
    out: dict[str, Any] = {"name": handle.name, "kv_quant": handle.options.kv_quant,
                           "sessions_max": handle.options.sessions, "context": handle.context}
    if stats is None:  # the engine has not stepped yet
        pool = handle.engine.core.pool.groups
        runner = handle.engine.core.runner
        out.update(sessions=[], clients=[], num_waiting=0, num_steps=0, num_ahead_steps=0,
                   graphs=getattr(runner, "num_graphs", 0), graphs_pending=0,
                   num_preemptions=0,
                   itl_target_ms=None, recent_itl_ms=[], prefix_hit_tokens=0,
                   prefix_query_tokens=0, last_plan=None, slow_steps=[],
                   kv=[{"group": g, "format": handle.options.kv_quant, "num_pages": p.num_pages,
                        "num_used": p.num_pages - p.num_free, "num_free": p.num_free,
                        "num_cached": 0} for g, p in pool.items()])
        return out
    out.update(
        sessions=[dataclasses.asdict(s) for s in stats.sessions],
        kv=[{**dataclasses.asdict(g), "format": handle.options.kv_quant} for g in stats.kv],
        clients=[dataclasses.asdict(c) for c in stats.clients],
        num_waiting=stats.num_waiting, num_steps=stats.num_steps,
        num_ahead_steps=stats.num_ahead_steps,
        graphs=stats.graphs, graphs_pending=stats.graphs_pending,
        num_preemptions=stats.num_preemptions, itl_target_ms=stats.itl_target_ms,
        recent_itl_ms=list(stats.recent_itl_ms[-RECENT_ITL:]),
        prefix_hit_tokens=stats.prefix_hit_tokens, prefix_query_tokens=stats.prefix_query_tokens,
        last_plan=None if stats.last_plan is None else dataclasses.asdict(stats.last_plan),
        slow_steps=slow_steps(stats.slow_steps, handle.engine.core.clock()))
    return out


def slow_steps(steps: Any, now: float) -> list[dict[str, Any]]:
    """The engine's latest steps over its ITL target (what every decoding stream waited
    for), newest first, each with its age in seconds instead of the engine's clock."""
    out = []
    for step in reversed(steps):
        item = dataclasses.asdict(step)
        item["age_s"] = round(now - item.pop("at_s"), 3)
        out.append(item)
    return out
