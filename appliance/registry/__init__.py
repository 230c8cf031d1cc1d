"""The model registry (SQLite `models` table) and its records."""

from __future__ import annotations

from appliance.registry.service import DEFAULT_MODEL, ModelRecord, ModelRegistry

__all__ = ["DEFAULT_MODEL", "ModelRecord", "ModelRegistry"]
