"""/tokenize and /detokenize at the root, where vLLM serves them."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, post
from litestar.di import Provide

from appliance.server.controllers.deps import Caller, Server, provide_principal, provide_server
from appliance.server.schemas import DetokenizeRequest, TokenizeRequest, decode_body
from appliance.server.services import tokens


class TokensController(Controller):
    path = "/"
    dependencies = {"server": Provide(provide_server, sync_to_thread=False),
                    "principal": Provide(provide_principal)}

    @post("/tokenize", status_code=200)
    async def tokenize(self, request: Request, server: Server,
                       principal: Caller) -> dict[str, Any]:
        body = decode_body(await request.body(), TokenizeRequest)
        return await tokens.tokenize(server.router, principal, body)

    @post("/detokenize", status_code=200)
    async def detokenize(self, request: Request, server: Server,
                         principal: Caller) -> dict[str, Any]:
        body = decode_body(await request.body(), DetokenizeRequest)
        return await tokens.detokenize(server.router, principal, body)
