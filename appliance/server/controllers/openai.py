"""OpenAI-compatible endpoints under /v1."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.di import Provide
from litestar.params import FromPath
from msgspec import Struct

from appliance.auth import check_model_allowed
from appliance.server.controllers.deps import Caller, Server, provide_principal, provide_server
from appliance.server.errors import Unsupported
from appliance.server.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    Name,
    decode_body,
)


class ModelOnly(Struct):
    model: Name | None = None


class OpenAIController(Controller):
    path = "/v1"
    dependencies = {"server": Provide(provide_server, sync_to_thread=False),
                    "principal": Provide(provide_principal)}

    @post("/chat/completions", status_code=200)
    async def chat_completions(self, request: Request, server: Server,
                               principal: Caller) -> Response:
        body = decode_body(await request.body(), ChatCompletionRequest)
        return await server.completions.chat(principal, body, request.receive)

    @post("/completions", status_code=200)
    async def completions(self, request: Request, server: Server,
                          principal: Caller) -> Response:
        body = decode_body(await request.body(), CompletionRequest)
        return await server.completions.text(principal, body, request.receive)

    @get("/models")
    async def list_models(self, server: Server, principal: Caller) -> dict[str, Any]:
        allowed = principal.quota.allowed_models
        data = [_model_card(h) for h in server.router.handles()
                if allowed is None or h.name in allowed]
        return {"object": "list", "data": data}

    @get("/models/{name:str}")
    async def get_model(self, server: Server, principal: Caller,
                        name: FromPath[str]) -> dict[str, Any]:
        handle = server.router.get(name)
        check_model_allowed(principal, handle.name)
        return _model_card(handle)

    @post("/embeddings", status_code=200)
    async def embeddings(self, request: Request, server: Server,
                         principal: Caller) -> dict[str, Any]:
        body = decode_body(await request.body(), EmbeddingRequest)
        return await server.embeddings.create(principal, body, request.receive)

    @post("/rerank", status_code=200)
    async def rerank(self, request: Request, server: Server,
                     principal: Caller) -> Response:
        return await _unsupported(request, server, principal, "reranking")


def _model_card(handle: Any) -> dict[str, Any]:
    return {"id": handle.name, "object": "model", "created": handle.created,
            "owned_by": "mbufo", "max_model_len": handle.context}


async def _unsupported(request: Request, server: Server, principal: Caller,
                       what: str) -> Response:
    """No model served today reranks: say so in an OpenAI error body (400)."""
    body = decode_body(await request.body(), ModelOnly)
    handle = server.router.get(body.model)
    check_model_allowed(principal, handle.name)
    raise Unsupported(f"the model '{handle.name}' does not support {what}: it is a text "
                      f"generation model", code="model_not_supported", param="model")
