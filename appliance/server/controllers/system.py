"""Health and Prometheus metrics (no key needed: neither carries a secret or a prompt)."""

from __future__ import annotations

from litestar import Response, get
from litestar.di import Provide

from appliance.server.controllers.deps import Server, provide_server
from appliance.server.metrics import CONTENT_TYPE

_deps = {"server": Provide(provide_server, sync_to_thread=False)}


@get("/health", dependencies=_deps)
async def health(server: Server) -> Response:
    models = [h.name for h in server.router.handles()]
    if server.generation.is_draining:
        return Response({"status": "shutting_down", "models": models}, status_code=503)
    return Response({"status": "ok" if models else "no_models", "models": models})


@get("/metrics", dependencies=_deps, sync_to_thread=False)
def metrics(server: Server) -> Response:
    return Response(server.metrics.render(), media_type=CONTENT_TYPE)
