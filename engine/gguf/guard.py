"""Bounded pre-scan of a GGUF file, run before gguf.GGUFReader sees it.

gguf.GGUFReader trusts every count it reads: an array length of 2**63 makes it loop for
ever (a 49-byte file is enough), an array of arrays recurses until RecursionError, and a
string length past the end silently yields a short read. This scan walks the same layout
(little-endian GGUF v2/v3: header, key/values, tensor infos, aligned data) and checks every
length, type and offset against the bytes that remain, so that nothing is allocated or
looped over in proportion to a claimed count before that count is known to fit. It only
checks; the values themselves are read by gguf.GGUFReader. The result carries the layout
it derived so that the loader can cross-check the reader against it.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from engine.errors import GGUFFormatError, ModelNotFound, UnsupportedTensorType

# What the scan reads: the whole file's bytes, mapped or in memory.
Buffer = bytes | bytearray | memoryview | mmap.mmap

HEADER_BYTES = 24  # magic u32, version u32, n_tensors u64, n_kv u64
SUPPORTED_VERSIONS = (2, 3)  # what gguf.GGUFReader reads; v1 used 32-bit counts
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 1024  # keys and tensor names; real ones are < 100 bytes
MAX_STRING_BYTES = 1 << 26  # one string value (chat templates are ~10 KiB)
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 16  # the largest MoE files hold a few thousand
# Summed over every metadata array of the file. The reader keeps one or two numpy views
# per element (~100 bytes each), so this bounds its memory; vocabularies with merges are
# well under a million elements.
MAX_ARRAY_ELEMENTS = 1 << 23
DEFAULT_ALIGNMENT = 32
# The spec asks for a multiple of 8; the top bounds the padding before the data section.
MIN_ALIGNMENT, MAX_ALIGNMENT = 8, 1 << 24
INT64_MAX = (1 << 63) - 1  # GGML counts elements in int64
# The names gguf.GGUFReader gives the header fields; a key with one of them would collide.
RESERVED_KEYS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_SCALAR_BYTES: dict[int, int] = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, name, n_dims, 1 dim, type, offset


@dataclass(frozen=True, slots=True)
class TensorSpan:
    name: str
    offset: int  # absolute offset of the data in the file
    n_bytes: int


@dataclass(frozen=True, slots=True)
class ScanResult:
    version: int
    alignment: int
    data_offset: int  # start of the data section (end of the tensor infos, aligned)
    n_kv: int
    tensors: tuple[TensorSpan, ...]


def scan_file(path: str | os.PathLike[str]) -> ScanResult:
    """Check a GGUF file; raise GGUFFormatError / UnsupportedTensorType naming the field."""
    try:
        # O_NONBLOCK: a FIFO in place of the model must not block the open.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except (FileNotFoundError, NotADirectoryError) as e:
        raise ModelNotFound(f"no model file at {os.fspath(path)!r}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelNotFound(f"{os.fspath(path)!r} is not a regular file")
        if st.st_size < HEADER_BYTES:
            raise GGUFFormatError(
                f"file is {st.st_size} bytes, too small for the {HEADER_BYTES}-byte GGUF header")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
            return scan_buffer(buf)
    finally:
        os.close(fd)


def scan_buffer(buf: Buffer) -> ScanResult:
    """Check the bytes of a whole GGUF file (bytes, mmap, ...)."""
    return _Scan(buf).run()


def _type_name(raw: int) -> str:
    try:
        return GGUFValueType(raw).name
    except ValueError:
        return f"unknown type {raw}"


class _Scan:
    """A cursor over the file; every read first checks that its bytes exist."""

    def __init__(self, buf: Buffer) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.alignment = DEFAULT_ALIGNMENT
        self.array_elements = 0

    def run(self) -> ScanResult:
        version, n_tensors, n_kv = self._header()
        self._kvs(n_kv)
        infos = self._tensor_infos(n_tensors)
        data_offset = -(-self.pos // self.alignment) * self.alignment
        spans = tuple(self._check_data(data_offset, *info) for info in infos)
        return ScanResult(version, self.alignment, data_offset, n_kv, spans)

    def _take(self, n: int, what: str) -> int:
        """Advance over n bytes; return where they start."""
        start = self.pos
        if n > self.size - start:
            raise GGUFFormatError(
                f"{what}: {n} bytes at offset {start} run past end of file (size {self.size})")
        self.pos = start + n
        return start

    def _u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self._take(4, what))[0]

    def _u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self._take(8, what))[0]

    def _name(self, what: str) -> str:
        n = self._u64(f"{what} length")
        if not 1 <= n <= MAX_NAME_BYTES:
            raise GGUFFormatError(f"{what} length {n} is not in 1..{MAX_NAME_BYTES}")
        start = self._take(n, what)
        try:
            return bytes(self.buf[start : start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFFormatError(f"{what} at offset {start} is not valid UTF-8") from None

    def _header(self) -> tuple[int, int, int]:
        magic = bytes(self.buf[0:4])
        if magic != b"GGUF":
            raise GGUFFormatError(f"bad magic {magic!r} (a GGUF file starts with b'GGUF')")
        self.pos = 4
        version = self._u32("version")
        if version not in SUPPORTED_VERSIONS:
            if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
                raise GGUFFormatError(
                    f"GGUF version {version} is a byte-swapped version: big-endian GGUF files "
                    "are not supported")
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3)")
        n_tensors = self._u64("tensor count")
        n_kv = self._u64("kv count")
        _check_count("kv count", n_kv, MAX_KV, _MIN_KV_BYTES, self.size - self.pos)
        # Checked again, exactly, once the key/values are behind us.
        _check_count("tensor count", n_tensors, MAX_TENSORS, _MIN_TENSOR_INFO_BYTES,
                     self.size - self.pos)
        return version, n_tensors, n_kv

    def _kvs(self, n_kv: int) -> None:
        seen: set[str] = set()
        for i in range(n_kv):
            key = self._name(f"kv {i} key")
            if key in seen or key in RESERVED_KEYS:
                raise GGUFFormatError(f"duplicate or reserved key '{key}' (kv {i})")
            seen.add(key)
            vtype = self._u32(f"key '{key}': value type")
            if key == "general.alignment":
                self._alignment(vtype)
            else:
                self._value(key, vtype)

    def _alignment(self, vtype: int) -> None:
        if vtype != GGUFValueType.UINT32:
            raise GGUFFormatError(
                f"key 'general.alignment' must be UINT32, found {_type_name(vtype)}")
        value = self._u32("key 'general.alignment'")
        if value & (value - 1) or not MIN_ALIGNMENT <= value <= MAX_ALIGNMENT:
            raise GGUFFormatError(
                f"key 'general.alignment' = {value} is not a power of two in "
                f"[{MIN_ALIGNMENT}, {MAX_ALIGNMENT}]")
        self.alignment = value

    def _value(self, key: str, vtype: int) -> None:
        n = _SCALAR_BYTES.get(vtype)
        if n is not None:
            self._take(n, f"key '{key}': {_type_name(vtype)} value")
        elif vtype == GGUFValueType.STRING:
            n = self._u64(f"key '{key}': string length")
            if n > MAX_STRING_BYTES:
                raise GGUFFormatError(
                    f"key '{key}': string length {n} exceeds the limit {MAX_STRING_BYTES}")
            self._take(n, f"key '{key}': string")
        elif vtype == GGUFValueType.ARRAY:
            self._array(key)
        else:
            raise GGUFFormatError(f"key '{key}': unknown value type {vtype}")

    def _array(self, key: str) -> None:
        etype = self._u32(f"key '{key}': array element type")
        if etype == GGUFValueType.ARRAY:
            raise GGUFFormatError(f"key '{key}': nested arrays (array of arrays) are not supported")
        count = self._u64(f"key '{key}': array length")
        self.array_elements += count
        if self.array_elements > MAX_ARRAY_ELEMENTS:
            raise GGUFFormatError(
                f"key '{key}': array of {count} elements exceeds the limit of "
                f"{MAX_ARRAY_ELEMENTS} metadata array elements per file")
        n = _SCALAR_BYTES.get(etype)
        if n is not None:
            self._take(count * n, f"key '{key}': array of {count} {_type_name(etype)}")
        elif etype == GGUFValueType.STRING:
            self._string_array(key, count)
        else:
            raise GGUFFormatError(f"key '{key}': unknown array element type {etype}")

    def _string_array(self, key: str, count: int) -> None:
        # The hot loop of a real file (262144 tokens): locals only, one unpack per string.
        buf, size, pos = self.buf, self.size, self.pos
        if count * 8 > size - pos:
            raise GGUFFormatError(
                f"key '{key}': array of {count} strings cannot fit in the {size - pos} bytes left")
        unpack = _U64.unpack_from
        for i in range(count):
            if pos + 8 > size:
                raise GGUFFormatError(f"key '{key}': string {i} length runs past end of file")
            n = unpack(buf, pos)[0]
            pos += 8 + n
            if pos > size:
                raise GGUFFormatError(
                    f"key '{key}': string {i} ({n} bytes) runs past end of file (size {size})")
        self.pos = pos

    def _tensor_infos(self, n_tensors: int) -> list[tuple[str, int, int]]:
        _check_count("tensor count", n_tensors, MAX_TENSORS, _MIN_TENSOR_INFO_BYTES,
                     self.size - self.pos)
        names: set[str] = set()
        infos = []
        for i in range(n_tensors):
            name = self._name(f"tensor {i} name")
            if name in names:
                raise GGUFFormatError(f"duplicate tensor name '{name}'")
            names.add(name)
            what = f"tensor '{name}'"
            n_dims = self._u32(f"{what}: n_dims")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"{what}: n_dims {n_dims} is not in 1..{MAX_DIMS}")
            dims = struct.unpack_from(f"<{n_dims}Q", self.buf, self._take(8 * n_dims, what))
            n_bytes = _tensor_bytes(what, dims, self._u32(f"{what}: type"))
            infos.append((name, self._u64(f"{what}: data offset"), n_bytes))
        return infos

    def _check_data(self, data_offset: int, name: str, rel: int, n_bytes: int) -> TensorSpan:
        if rel % self.alignment:
            raise GGUFFormatError(
                f"tensor '{name}': data offset {rel} is not a multiple of the alignment "
                f"{self.alignment}")
        start = data_offset + rel
        if start + n_bytes > self.size:
            raise GGUFFormatError(
                f"tensor '{name}': data [{start}, {start + n_bytes}) extends past end of file "
                f"(size {self.size})")
        return TensorSpan(name, start, n_bytes)


def _check_count(what: str, count: int, limit: int, min_bytes: int, remaining: int) -> None:
    """A count read from the file, before anything is looped over or allocated for it."""
    if count > limit:
        raise GGUFFormatError(f"{what} {count} exceeds the limit {limit}")
    if count * min_bytes > remaining:
        raise GGUFFormatError(
            f"{what} {count} cannot fit in the {remaining} bytes left ({min_bytes} bytes each "
            f"at least)")


def _tensor_bytes(what: str, dims: tuple[int, ...], raw_type: int) -> int:
    """Byte size of a tensor with GGML dims ne[0..] (innermost first) and type raw_type."""
    if 0 in dims:
        raise GGUFFormatError(f"{what}: dims {list(dims)} contain 0")
    n_elements = 1
    for d in dims:
        n_elements *= d  # Python ints do not wrap; compare with what GGML can hold
        if n_elements > INT64_MAX:
            raise GGUFFormatError(f"{what}: dims {list(dims)} overflow the int64 element count")
    try:
        qtype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise UnsupportedTensorType(f"{what}: unknown GGML type {raw_type}") from None
    if dims[0] % block:
        raise GGUFFormatError(
            f"{what}: row length ne[0]={dims[0]} is not a multiple of the {qtype.name} "
            f"block size {block}")
    return n_elements // block * type_size
