"""ModelFile: a checked, memory-mapped GGUF file (metadata, tensor infos, raw tensor bytes)."""

from __future__ import annotations

import logging
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.errors import GGUFFormatError
from engine.gguf.guard import RESERVED_KEYS, ScanResult, scan_file
from engine.gguf.reader import MappedReader, field_value

logger = logging.getLogger(__name__)

_MISSING = object()


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # torch order: outermost first (= reversed GGML ne)
    n_elements: int
    n_bytes: int
    offset: int  # absolute offset of the data in the file


class ModelFile:
    """A GGUF file opened with `ModelFile.open`: checked by guard.scan_file, then read by
    gguf.GGUFReader over a read-only mapping. Tensor bytes stay on the mapping; arrays
    returned by `tensor_data` keep it alive after `close()`."""

    path: pathlib.Path
    version: int
    alignment: int
    metadata: Mapping[str, Any]
    tensors: Mapping[str, TensorInfo]

    def __init__(self, path: pathlib.Path, reader: MappedReader, scan: ScanResult) -> None:
        self.path = path
        self.version = scan.version
        self.alignment = scan.alignment
        self.metadata = MappingProxyType(_metadata(reader))
        self.tensors = MappingProxyType(_tensor_infos(reader))
        self._data: npt.NDArray[np.uint8] | None = reader.data
        _cross_check(reader, scan, self.tensors)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> ModelFile:
        path = pathlib.Path(path)
        scan = scan_file(path)  # raises before the reader can hang or over-allocate
        try:
            reader = MappedReader(path, "r")
        except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError) as e:
            # The scan accepts only what the reader can parse; this is the second line.
            raise GGUFFormatError(f"{path}: rejected by gguf.GGUFReader: {e}") from e
        logger.debug("opened %s: %d keys, %d tensors", path, scan.n_kv, len(scan.tensors))
        return cls(path, reader, scan)

    @property
    def architecture(self) -> str:
        return self.require("general.architecture", str)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str, kind: type | tuple[type, ...] = object) -> Any:
        """The value of `key`; GGUFFormatError naming it if missing or not of `kind`
        (an int is accepted where a float is asked; a bool is never an int)."""
        value = self.metadata.get(key, _MISSING)
        if value is _MISSING:
            raise GGUFFormatError(f"{self.path.name}: missing metadata key '{key}'")
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and int not in kinds:
            kinds = (*kinds, int)
        is_bool_as_number = isinstance(value, bool) and bool not in kinds and object not in kinds
        if is_bool_as_number or not isinstance(value, kinds):
            wanted = " or ".join(k.__name__ for k in kinds)
            raise GGUFFormatError(
                f"{self.path.name}: metadata key '{key}' must be {wanted}, "
                f"found {type(value).__name__}")
        return value

    def arch_get(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{suffix}", default)

    def arch_require(self, suffix: str, kind: type | tuple[type, ...] = object) -> Any:
        return self.require(f"{self.architecture}.{suffix}", kind)

    def tensor_data(self, name: str) -> npt.NDArray[np.uint8]:
        """The raw (GGML block) bytes of a tensor: a read-only 1-D uint8 view, no copy."""
        info = self.tensors.get(name)
        if info is None:
            raise GGUFFormatError(f"{self.path.name}: no tensor named '{name}'")
        if self._data is None:
            raise GGUFFormatError(f"{self.path.name}: file is closed")
        return self._data[info.offset : info.offset + info.n_bytes]

    def close(self) -> None:
        # Only drop the reference: unmapping would invalidate views already handed out.
        self._data = None

    def __enter__(self) -> ModelFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ModelFile({str(self.path)!r}, {len(self.tensors)} tensors)"


def _metadata(reader: MappedReader) -> dict[str, Any]:
    # Skip the reader's own header pseudo-fields (GGUF.version, ...); the scan reserved them.
    return {k: field_value(reader, f) for k, f in reader.fields.items() if k not in RESERVED_KEYS}


def _tensor_infos(reader: MappedReader) -> dict[str, TensorInfo]:
    infos = {}
    for t in reader.tensors:
        ne = tuple(int(d) for d in t.shape)  # GGML order: innermost first
        infos[t.name] = TensorInfo(
            name=t.name, ggml_type=int(t.tensor_type), shape=ne[::-1],
            n_elements=int(t.n_elements), n_bytes=int(t.n_bytes), offset=int(t.data_offset))
    return infos


def _cross_check(reader: MappedReader, scan: ScanResult, tensors: Mapping[str, TensorInfo]) -> None:
    """The scan and the reader parsed the same bytes independently; they must agree."""
    found = [(t.name, t.offset, t.n_bytes) for t in tensors.values()]
    expected = [(s.name, s.offset, s.n_bytes) for s in scan.tensors]
    if int(reader.data_offset) != scan.data_offset or found != expected:
        raise GGUFFormatError(
            f"gguf.GGUFReader and the pre-scan disagree on the layout "
            f"(data offset {reader.data_offset} vs {scan.data_offset})")
