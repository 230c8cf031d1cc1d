"""gguf.GGUFReader with faster storage, and the conversion of its fields to Python values.

The stock reader spends ~24 s of CPU on a 262144-token vocabulary (gemma3 270M): every
element of every metadata array becomes its own slice of an `np.memmap`, whose Python-level
`__getitem__`/`__array_finalize__` dominate. `MappedReader` keeps gguf's parsing and its
`ReaderField` layout (parts, data indices, types) exactly and changes only how bytes are
fetched: a plain ndarray view of the same mapping, and fixed-size arrays read in one call
then split into the per-element views the stock reader would build. Tests compare it with
the stock reader field by field. It must only see files that `guard.scan_file` accepted:
its reads are not bounds-checked beyond what numpy's slicing does.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType, ReaderField

# Byte-order codes the stock reader passes to `newbyteorder` that leave a dtype unchanged.
_NATIVE_ORDERS = frozenset({"I", "=", "<" if sys.byteorder == "little" else ">"})
_ARRAY_HEAD_PARTS = 5  # key length, key, value type, element type, element count


class MappedReader(GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of its memmap (read-only mode)."""

    @property  # type: ignore[override]
    def data(self) -> npt.NDArray[np.uint8]:
        return self._data

    @data.setter
    def data(self, value: npt.NDArray[Any]) -> None:
        # GGUFReader.__init__ assigns its np.memmap here; keep a base-class view of it (the
        # view holds the mapping alive through .base).
        self._data = np.asarray(value)

    def _get(
        self, offset: int, dtype: npt.DTypeLike, count: int = 1,
        override_order: str | None = None,
    ) -> npt.NDArray[Any]:
        dt = np.dtype(dtype)
        arr = self._data[offset : offset + dt.itemsize * int(count)].view(dt)
        order = self.byte_order if override_order is None else override_order
        return arr if order in _NATIVE_ORDERS else arr.view(dt.newbyteorder(order))

    def _get_field_parts(
        self, orig_offs: int, raw_type: int,
    ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        # Same parts as the stock reader: [element type, count, e0, e1, ...] for fixed-size
        # elements, [element type, count, len0, bytes0, len1, bytes1, ...] for strings.
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        count, itype = int(alen[0]), GGUFValueType(raw_itype[0])
        parts: list[npt.NDArray[Any]] = [raw_itype, alen]
        types = [GGUFValueType.ARRAY] + ([itype] if count else [])
        offs = orig_offs + 12
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            whole = self._get(offs, nptype, count)
            parts += list(whole.reshape(count, 1))
            return 12 + int(whole.nbytes), parts, list(range(2, 2 + count)), types
        if itype != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)  # raises as the stock one
        # The hot loop of a real vocabulary: _get inlined (two slices and a view per string).
        data, u64 = self._data, np.dtype(np.uint64)
        if self.byte_order not in _NATIVE_ORDERS:
            u64 = u64.newbyteorder(self.byte_order)
        for _ in range(count):
            slen = data[offs : offs + 8].view(u64)
            n = int(slen[0])
            parts.append(slen)
            parts.append(data[offs + 8 : offs + 8 + n])
            offs += 8 + n
        return offs - orig_offs, parts, list(range(3, 3 + 2 * count, 2)), types


def field_value(reader: GGUFReader, field: ReaderField) -> Any:
    """A field as str / int / float / bool, numeric arrays as native-order numpy arrays
    (copies: they outlive the mapping), string arrays as list[str] (UTF-8, errors replaced)."""
    vtype = field.types[0]
    if vtype == GGUFValueType.STRING:
        return field.parts[-1].tobytes().decode("utf-8", "replace")
    if vtype != GGUFValueType.ARRAY:
        value = field.parts[-1][0]
        return bool(value) if vtype == GGUFValueType.BOOL else value.item()
    itype = GGUFValueType(int(field.parts[3][0]))
    if itype == GGUFValueType.STRING:
        parts = field.parts
        return [parts[i].tobytes().decode("utf-8", "replace") for i in field.data]
    count = int(field.parts[4][0])
    if itype == GGUFValueType.BOOL:
        nptype: npt.DTypeLike = np.uint8  # bytes other than 0/1 must still read as True
    else:
        nptype = reader.gguf_scalar_to_np[itype]
    # The elements are contiguous after the 5 head parts: one view instead of `count` parts.
    start = field.offset + sum(int(p.nbytes) for p in field.parts[:_ARRAY_HEAD_PARTS])
    dt = np.dtype(nptype)
    arr = reader._get(start, dt, count)
    native = arr.astype(dt.newbyteorder("="), copy=True)
    return native != 0 if itype == GGUFValueType.BOOL else native
