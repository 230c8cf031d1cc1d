"""Health and Prometheus metrics (no key needed: neither carries a secret or a prompt)."""

from __future__ import annotations

from litestar import Response, get
from litestar.di import Provide

from appliance.server.controllers.deps import provide_server
from appliance.server.metrics import CONTENT_TYPE
from appliance.server.state import ServerState

_deps = {"server": Provide(provide_server, sync_to_thread=False)}


@get("/health", dependencies=_deps)
async def health(server: ServerState) -> Response:
    models = [h.name for h in server.router.handles()]
    if server.generation.is_draining:
        return Response({"status": "shutting_down", "models": models}, status_code=503)
    return Response({"status": "ok" if models else "no_models", "models": models})


@get("/metrics", dependencies=_deps, sync_to_thread=False)
def metrics(server: ServerState) -> Response:
    return Response(server.metrics.render(), media_type=CONTENT_TYPE)
