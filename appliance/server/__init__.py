"""`mbufo serve`: the OpenAI-compatible server, model router, admin API and metrics."""

from __future__ import annotations

from appliance.server.app import create_app
from appliance.server.state import ServerState, open_state

__all__ = ["ServerState", "create_app", "open_state"]
