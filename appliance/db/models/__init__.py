"""ORM models, one entity per module: columns and relations only; rules live in services."""

from __future__ import annotations

from appliance.db.models.api_key import ApiKey
from appliance.db.models.base import Base
from appliance.db.models.model_entry import ModelEntry
from appliance.db.models.quota import KeyQuota
from appliance.db.models.setting import Setting
from appliance.db.models.usage import UsageRecord
from appliance.db.models.user import User

__all__ = ["ApiKey", "Base", "KeyQuota", "ModelEntry", "Setting", "UsageRecord", "User"]
