"""One finished (or failed) request. key_id is deliberately not a foreign key: usage
outlives keys, and a no-auth server records requests under a key id no row holds."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Index, Integer, String
from sqlalchemy.orm import Mapped, mapped_column

from appliance.db.models.base import Base
from appliance.db.types import UTCDateTime, utcnow


class UsageRecord(Base):
    __tablename__ = "usage"
    __table_args__ = (Index("ix_usage_key_id_created_at", "key_id", "created_at"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key_id: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(128))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)  # part of prompt_tokens
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
