"""The Litestar application factory."""

from __future__ import annotations

import logging

from litestar import Litestar
from litestar.config.cors import CORSConfig
from litestar.datastructures import State

from appliance.server.controllers.admin import AdminController
from appliance.server.controllers.openai import OpenAIController
from appliance.server.controllers.system import health, metrics
from appliance.server.controllers.tokens import TokensController
from appliance.server.errors import exception_hook
from appliance.server.middleware import security_headers
from appliance.server.state import ServerState

log = logging.getLogger(__name__)


def create_app(server: ServerState, *, start_models: bool = True) -> Litestar:
    """The app around `server`; startup loads the configured models unless `start_models`
    is False (tests load what they need), shutdown stops the engines and flushes usage."""
    settings = server.settings
    cors = None
    if settings.cors_origins:
        cors = CORSConfig(allow_origins=list(settings.cors_origins),
                          allow_methods=["GET", "POST", "PATCH", "OPTIONS"],
                          allow_headers=["Authorization", "Content-Type"])

    async def startup() -> None:
        if start_models:
            await server.start()
        else:
            server.metrics.queue.start()

    return Litestar(
        route_handlers=[OpenAIController, TokensController, AdminController, health, metrics],
        exception_handlers={Exception: exception_hook},
        before_send=[security_headers],
        cors_config=cors,
        request_max_body_size=settings.max_body_bytes,
        on_startup=[startup],
        on_shutdown=[server.close],
        state=State({"server": server}),
        openapi_config=None,
        logging_config=None,
    )
