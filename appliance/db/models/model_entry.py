"""A GGUF model known to the appliance, with its serving defaults (None = server setting)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from appliance.db.models.base import Base
from appliance.db.types import UTCDateTime, utcnow


class ModelEntry(Base):
    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    architecture: Mapped[str] = mapped_column(String(64))
    file_type: Mapped[str] = mapped_column(String(32))  # "Q4_K_M", "F16", ...
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sessions: Mapped[int | None] = mapped_column(Integer)
    context: Mapped[int | None] = mapped_column(Integer)
    kv_quant: Mapped[str | None] = mapped_column(String(16))
    added_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
