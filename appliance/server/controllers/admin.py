"""The admin API under /admin/api (admin keys only: user keys get 403)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from litestar import Controller, Request, get, patch, post
from litestar.di import Provide
from litestar.params import FromPath, FromQuery

from appliance.server.controllers.deps import Caller, Server, provide_admin, provide_server
from appliance.server.schemas import AddModel, CreateKey, ModelRef, QuotaPatch, decode_body


class AdminController(Controller):
    path = "/admin/api"
    dependencies = {"server": Provide(provide_server, sync_to_thread=False),
                    "admin": Provide(provide_admin)}

    @get("/models")
    async def models(self, server: Server, admin: Caller) -> dict[str, Any]:
        return await server.admin.models()

    @post("/models", status_code=201)
    async def add_model(self, request: Request, server: Server,
                        admin: Caller) -> dict[str, Any]:
        return await server.admin.add(decode_body(await request.body(), AddModel))

    @post("/models/remove", status_code=200)
    async def remove_model(self, request: Request, server: Server,
                           admin: Caller) -> dict[str, Any]:
        return await server.admin.remove(decode_body(await request.body(), ModelRef).name)

    @post("/models/load", status_code=200)
    async def load_model(self, request: Request, server: Server,
                         admin: Caller) -> dict[str, Any]:
        return await server.admin.load(decode_body(await request.body(), ModelRef))

    @post("/models/unload", status_code=200)
    async def unload_model(self, request: Request, server: Server,
                           admin: Caller) -> dict[str, Any]:
        return await server.admin.unload(decode_body(await request.body(), ModelRef).name)

    @get("/keys")
    async def keys(self, server: Server, admin: Caller) -> dict[str, Any]:
        return await server.admin.list_keys()

    @post("/keys", status_code=201)
    async def create_key(self, request: Request, server: Server,
                         admin: Caller) -> dict[str, Any]:
        return await server.admin.create_key(decode_body(await request.body(), CreateKey))

    @post("/keys/{key_id:str}/revoke", status_code=200)
    async def revoke_key(self, server: Server, admin: Caller,
                         key_id: FromPath[str]) -> dict[str, Any]:
        return await server.admin.revoke_key(key_id)

    @patch("/keys/{key_id:str}/quota")
    async def set_quota(self, request: Request, server: Server, admin: Caller,
                        key_id: FromPath[str]) -> dict[str, Any]:
        return await server.admin.set_quota(key_id, decode_body(await request.body(),
                                                                QuotaPatch))

    @get("/usage")
    async def usage(self, server: Server, admin: Caller, since: FromQuery[datetime | None] = None,
                    key_id: FromQuery[str | None] = None) -> dict[str, Any]:
        return await server.admin.usage_summary(since, key_id)

    @get("/state")
    async def state(self, server: Server, admin: Caller) -> dict[str, Any]:
        return server.admin.state()
