"""Dependencies the handlers share: the server state and who the request runs as."""

from __future__ import annotations

from litestar import Request
from litestar.di import NamedDependency

from appliance.auth import Principal
from appliance.server.state import ServerState


def provide_server(request: Request) -> ServerState:
    return request.app.state["server"]


async def provide_principal(request: Request) -> Principal:
    server: ServerState = request.app.state["server"]
    return await server.access.principal(request.headers.get("authorization"))


async def provide_admin(request: Request) -> Principal:
    server: ServerState = request.app.state["server"]
    return await server.access.admin(request.headers.get("authorization"))


Server = NamedDependency[ServerState]
Caller = NamedDependency[Principal]
