"""The server's services, built once from Settings and shared by every handler.

`open_state` opens the database and the state services (keys, rate limiter, usage,
registry); tests may build a ServerState around services of their own. `start` loads the
configured models; `drain` and `close` are the two halves of a graceful shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from appliance.server.metrics import Metrics
from appliance.server.router import ModelRouter
from appliance.server.services.access import AccessService
from appliance.server.services.admin import AdminService
from appliance.server.services.completions import CompletionService
from appliance.server.services.embeddings import EmbeddingService
from appliance.server.services.generation import GenerationService
from appliance.settings import Settings
from engine.errors import EngineError

log = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05


@dataclass
class ServerState:
    settings: Settings
    db: Any
    keys: Any
    limiter: Any
    usage: Any
    registry: Any
    router: ModelRouter = field(init=False)
    metrics: Metrics = field(init=False)
    access: AccessService = field(init=False)
    generation: GenerationService = field(init=False)
    completions: CompletionService = field(init=False)
    embeddings: EmbeddingService = field(init=False)
    admin: AdminService = field(init=False)
    is_closed: bool = False
    startup_error: str | None = None  # why a configured model did not load at start

    def __post_init__(self) -> None:
        self.router = ModelRouter(self.settings, self.registry)
        self.metrics = Metrics(self.router)
        self.access = AccessService(self.keys, self.settings.no_auth)
        self.generation = GenerationService(self.router, self.limiter, self.metrics)
        self.completions = CompletionService(self.router, self.generation)
        self.embeddings = EmbeddingService(self.router, self.generation, self.limiter,
                                           self.metrics)
        self.admin = AdminService(self.router, self.registry, self.keys, self.usage)

    async def start(self) -> None:
        """Load the configured models in order (the first is the default)."""
        self.metrics.queue.start()
        for ref in self.settings.models:
            if ref in {h.name for h in self.router.handles()}:
                continue
            try:
                spec = await asyncio.to_thread(self.router.resolve, ref)
                await self.router.load(spec)
            except EngineError as exc:  # the server does not start; serve says why
                self.startup_error = f"model {ref!r} did not load: {exc}"
                raise

    async def drain(self, grace_s: float) -> None:
        """Refuse new work (503); let running requests finish for up to `grace_s`; then
        stop the engines, which ends the rest with a clear 'shutting down' error."""
        self.generation.is_draining = True
        deadline = time.monotonic() + grace_s
        while self.generation.num_jobs and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.generation.num_jobs:
            log.warning("stopping %d requests still running after %.0f s",
                        self.generation.num_jobs, grace_s)
        await self.router.stop_all()
        await asyncio.sleep(DRAIN_POLL_S)  # let the aborted streams send their error

    async def close(self) -> None:
        """Stop the engines and flush usage to the database (idempotent)."""
        if self.is_closed:
            return
        self.is_closed = True
        self.generation.is_draining = True
        await self.router.stop_all()
        await self.metrics.queue.stop()
        await asyncio.to_thread(self.limiter.close)
        if self.db is not None:
            self.db.close()


def open_state(settings: Settings) -> ServerState:
    from appliance.auth import KeyService
    from appliance.db import open_database
    from appliance.registry import ModelRegistry
    from appliance.usage import RateLimiter, UsageService

    db = open_database(settings)
    return ServerState(settings, db, KeyService(db), RateLimiter(db), UsageService(db),
                       ModelRegistry(db))
