"""ModelRegistry: the GGUF models the appliance can serve, by name.

add() validates the file with engine.gguf.ModelFile.open (a malformed file raises the
engine's typed GGUFFormatError; a missing one ModelNotFound), reads the architecture and
file type, and hashes the file. remove() forgets the entry; it never deletes the file.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import delete, select

from appliance.db import Database, StateError
from appliance.db.models import ModelEntry
from appliance.db.types import utcnow

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelRecord:
    name: str
    path: str
    sha256: str
    architecture: str
    file_type: str
    size_bytes: int
    sessions: int | None  # None: the server's setting
    context: int | None
    kv_quant: str | None
    added_at: datetime

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "sha256": self.sha256,
                "architecture": self.architecture, "file_type": self.file_type,
                "size_bytes": self.size_bytes, "sessions": self.sessions,
                "context": self.context, "kv_quant": self.kv_quant,
                "added_at": self.added_at.isoformat()}


class ModelRegistry:
    def __init__(self, db: Database) -> None:
        self._db = db

    def add(self, path_or_default: str, name: str | None = None, sessions: int | None = None,
            context: int | None = None, kv_quant: str | None = None) -> ModelRecord:
        from engine.loader import resolve_model_path

        _check_defaults(sessions, context, kv_quant)
        path = resolve_model_path(path_or_default).resolve()
        if name is None:
            name = DEFAULT_MODEL if path_or_default == DEFAULT_MODEL else path.stem
        if not _NAME.fullmatch(name):
            raise StateError(f"model name must be 1-128 of [A-Za-z0-9._:/-] starting with a "
                             f"letter or digit, got {name!r}")
        architecture, file_type = describe_gguf(path)
        size, digest = path.stat().st_size, sha256_file(path)
        with self._db.session(write=True) as session:
            if session.scalar(select(ModelEntry.id).where(ModelEntry.name == name)) is not None:
                raise StateError(f"a model named '{name}' is already registered",
                                 status=409, code="model_exists")
            row = ModelEntry(name=name, path=str(path), sha256=digest,
                             architecture=architecture, file_type=file_type, size_bytes=size,
                             sessions=sessions, context=context, kv_quant=kv_quant,
                             added_at=utcnow())
            session.add(row)
            session.flush()
            record = _record(row)
        log.info("registered model %s (%s %s, %d bytes) from %s", name, architecture,
                 file_type, size, path)
        return record

    def list(self) -> list[ModelRecord]:
        with self._db.session() as session:
            return [_record(r) for r in session.scalars(select(ModelEntry)
                                                        .order_by(ModelEntry.name))]

    def get(self, name: str) -> ModelRecord | None:
        with self._db.session() as session:
            row = session.scalar(select(ModelEntry).where(ModelEntry.name == name))
            return None if row is None else _record(row)

    def remove(self, name: str) -> bool:
        with self._db.session(write=True) as session:
            removed = session.execute(delete(ModelEntry).where(ModelEntry.name == name))
            found = bool(removed.rowcount)
        if found:
            log.info("removed model %s from the registry", name)
        return found


def describe_gguf(path: Path) -> tuple[str, str]:
    """(general.architecture, file type name such as 'Q4_K_M') of a checked GGUF file."""
    import gguf

    from engine.gguf import ModelFile

    with ModelFile.open(path) as mf:
        architecture = mf.architecture
        code = mf.get("general.file_type")
        if isinstance(code, int) and not isinstance(code, bool):
            try:
                return architecture, gguf.LlamaFileType(code).name.removeprefix("MOSTLY_")
            except ValueError:
                return architecture, f"unknown({code})"
        # No file type recorded: name the most common type among matrices.
        types = Counter(t.ggml_type for t in mf.tensors.values() if len(t.shape) >= 2)
        if not types:
            return architecture, "unknown"
        return architecture, gguf.GGMLQuantizationType(types.most_common(1)[0][0]).name


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_defaults(sessions: int | None, context: int | None, kv_quant: str | None) -> None:
    from engine.kv.formats import KV_QUANT_CHOICES

    for label, value in (("sessions", sessions), ("context", context)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise StateError(f"{label} must be an integer >= 1, got {value!r}")
    if kv_quant is not None and kv_quant not in KV_QUANT_CHOICES:
        raise StateError(f"kv_quant must be one of {', '.join(KV_QUANT_CHOICES)}, "
                         f"got {kv_quant!r}")


def _record(row: ModelEntry) -> ModelRecord:
    return ModelRecord(name=row.name, path=row.path, sha256=row.sha256,
                       architecture=row.architecture, file_type=row.file_type,
                       size_bytes=row.size_bytes, sessions=row.sessions, context=row.context,
                       kv_quant=row.kv_quant, added_at=row.added_at)
