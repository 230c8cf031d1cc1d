"""GGUF tokenizer metadata for the tests, read with gguf.GGUFReader's parser and converted
here (not by engine.gguf.ModelFile, so that the tokenizer tests check the tokenizer alone).
The reader is engine.gguf's MappedReader: the stock parser over a plain ndarray view, which
its own tests compare field by field with the stock reader; the stock one spends ~25 s on a
262K-token vocabulary. Results are cached on disk, keyed by file size and mtime."""

from __future__ import annotations

import hashlib
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from engine.gguf.reader import MappedReader

CACHE = Path(os.environ.get("MBUFO_TEST_CACHE", Path.home() / ".cache" / "mbufo-tests"))
_FORMAT = 1  # bump when the cached representation changes


def _field_value(field: Any) -> Any:
    if field.types[0] != GGUFValueType.ARRAY:
        return field.contents()
    if field.types[-1] == GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
    if not len(field.data):
        return np.zeros(0)
    return np.concatenate([field.parts[i] for i in field.data])


def read_tokenizer_metadata(path: Path) -> dict[str, Any]:
    """`tokenizer.*` and `general.*` keys: scalars as Python values, string arrays as
    lists, numeric arrays as numpy arrays."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_FORMAT}".encode())
    cached = CACHE / "gguf-meta" / f"{path.stem}-{key.hexdigest()[:16]}.pkl"
    if cached.exists():
        with cached.open("rb") as f:
            return pickle.load(f)
    reader = MappedReader(path, "r")
    meta = {name: _field_value(field) for name, field in reader.fields.items()
            if name.startswith(("tokenizer.", "general."))}
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        pickle.dump(meta, f, protocol=pickle.HIGHEST_PROTOCOL)
    tmp.replace(cached)
    return meta
