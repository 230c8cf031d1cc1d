"""A key's client quota. Null limits are unlimited; null allowed_models means every model."""

from __future__ import annotations

from sqlalchemy import JSON, ForeignKey, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from appliance.db.models.base import Base


class KeyQuota(Base):
    __tablename__ = "quotas"

    key_id: Mapped[str] = mapped_column(
        String(16), ForeignKey("api_keys.id", ondelete="CASCADE"), primary_key=True)
    allowed_models: Mapped[list[str] | None] = mapped_column(JSON(none_as_null=True))
    max_pending: Mapped[int] = mapped_column(Integer, default=16, server_default="16")
    max_concurrent_streams: Mapped[int] = mapped_column(Integer, default=4, server_default="4")
    requests_per_min: Mapped[int | None] = mapped_column(Integer)
    tokens_per_min: Mapped[int | None] = mapped_column(Integer)
    tokens_per_day: Mapped[int | None] = mapped_column(Integer)
