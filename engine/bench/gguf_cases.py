"""Malformed GGUF files, crafted byte by byte, shared by the loader's tests and its benchmark.

`bad_cases()` returns (name, bytes) pairs; every one must be rejected by
`engine.gguf.ModelFile.open` with the error class `expected_error(name)` gives, within a
bounded time and memory. The encoder here is independent of engine.gguf (plain struct
packing after the GGUF spec), and `valid_file()` is what the mutations start from.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from engine.errors import EngineError, GGUFFormatError, UnsupportedTensorType

ALIGN = 32
NUM_TRUNCATIONS = 16


def u32(x: int) -> bytes:
    return struct.pack("<I", x)


def u64(x: int) -> bytes:
    return struct.pack("<Q", x)


def gstr(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string: u64 length (or a forged one) + bytes."""
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b) if length is None else length) + b


def kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def str_array(items: Sequence[str]) -> bytes:
    return u32(VT.STRING) + u64(len(items)) + b"".join(gstr(s) for s in items)


def tensor_info(name: str | bytes, ne: Sequence[int], ggml_type: int, offset: int,
                n_dims: int | None = None) -> bytes:
    dims = b"".join(u64(d) for d in ne)
    n_dims = len(ne) if n_dims is None else n_dims
    return gstr(name) + u32(n_dims) + dims + u32(ggml_type) + u64(offset)


def gguf_file(kvs: Sequence[bytes], infos: Sequence[bytes], data: bytes = b"", *,
              magic: bytes = b"GGUF", version: int = 3, n_tensors: int | None = None,
              n_kv: int | None = None, align: int = ALIGN) -> bytes:
    """Header + key/values + tensor infos + padding to `align` + data (no trailing pad)."""
    head = (magic + u32(version) + u64(len(infos) if n_tensors is None else n_tensors)
            + u64(len(kvs) if n_kv is None else n_kv))
    body = head + b"".join(kvs) + b"".join(infos)
    return body + bytes(-len(body) % align) + data if infos else body


def base_kvs(alignment_kv: bytes | None = None) -> list[bytes]:
    if alignment_kv is None:
        alignment_kv = kv("general.alignment", VT.UINT32, u32(ALIGN))
    return [
        kv("general.architecture", VT.STRING, gstr("tiny")),
        alignment_kv,
        kv("tiny.block_count", VT.UINT32, u32(2)),
        kv("tiny.rope.freq_base", VT.FLOAT32, struct.pack("<f", 10000.0)),
        kv("tiny.use_bias", VT.BOOL, b"\x01"),
        kv("tokenizer.ggml.tokens", VT.ARRAY, str_array(["<s>", "a", "bc"])),
        kv("tokenizer.ggml.scores", VT.ARRAY, u32(VT.FLOAT32) + u64(3) + bytes(12)),
    ]


# (name, ne, type, bytes): F32 4x2, F16 8, Q8_0 32x2; offsets are aligned to ALIGN.
BASE_TENSORS = [("a.weight", (4, 2), QT.F32, 32), ("b.weight", (8,), QT.F16, 16),
                ("c.weight", (32, 2), QT.Q8_0, 68)]


def base_infos(overrides: dict[str, bytes] | None = None) -> tuple[list[bytes], bytes]:
    """Tensor infos and data of BASE_TENSORS; `overrides` replaces one info by name."""
    infos, data = [], b""
    for name, ne, qtype, n_bytes in BASE_TENSORS:
        data += bytes(-len(data) % ALIGN)
        infos.append((overrides or {}).get(name, tensor_info(name, ne, qtype, len(data))))
        data += bytes((i * 7 + len(infos)) % 251 for i in range(n_bytes))
    return infos, data


def valid_file() -> bytes:
    infos, data = base_infos()
    return gguf_file(base_kvs(), infos, data)


def with_kv(*extra: bytes) -> bytes:
    infos, data = base_infos()
    return gguf_file([*base_kvs(), *extra], infos, data)


def with_info(name: str, info: bytes) -> bytes:
    infos, data = base_infos({name: info})
    return gguf_file(base_kvs(), infos, data)


def _header_cases() -> dict[str, bytes]:
    infos, data = base_infos()
    kvs = base_kvs()
    return {
        "empty_file": b"",
        "short_header": b"GGUF" + u32(3) + u64(0)[:4],
        "bad_magic": gguf_file(kvs, infos, data, magic=b"GGUX"),
        "bad_magic_lowercase": gguf_file(kvs, infos, data, magic=b"gguf"),
        "version_0": gguf_file(kvs, infos, data, version=0),
        "version_1": gguf_file(kvs, infos, data, version=1),
        "version_99": gguf_file(kvs, infos, data, version=99),
        "version_big_endian": gguf_file(kvs, infos, data, version=3 << 24),
        "n_tensors_huge": gguf_file(kvs, infos, data, n_tensors=2**64 - 1),
        "n_tensors_2pow63": gguf_file(kvs, infos, data, n_tensors=2**63),
        "n_tensors_one_more": gguf_file(kvs, infos, data, n_tensors=len(infos) + 1),
        "n_kv_huge": gguf_file(kvs, infos, data, n_kv=2**64 - 1),
        "n_kv_2pow32": gguf_file(kvs, infos, data, n_kv=2**32),
        "n_kv_one_more": gguf_file(kvs, infos, data, n_kv=len(kvs) + 1),
    }


def _kv_cases() -> dict[str, bytes]:
    tail = u32(VT.UINT8) + b"\x01"
    return {
        "key_len_huge": with_kv(gstr("k", 2**64 - 1) + tail),
        "key_len_past_eof": with_kv(gstr("k", 10**6) + tail),
        "key_len_zero": with_kv(gstr("") + tail),
        "key_len_over_limit": with_kv(gstr("k" * 2000) + tail),
        "key_not_utf8": with_kv(gstr(b"\xff\xfe") + tail),
        "key_duplicate": with_kv(kv("tiny.block_count", VT.UINT32, u32(3))),
        "key_reserved": with_kv(kv("GGUF.version", VT.UINT32, u32(3))),
        "value_type_13": with_kv(kv("x", 13, b"\x00" * 8)),
        "value_type_huge": with_kv(kv("x", 2**32 - 1, b"\x00" * 8)),
        "string_len_past_eof": with_kv(kv("x", VT.STRING, gstr("abc", 10**6))),
        "string_len_2pow63": with_kv(kv("x", VT.STRING, gstr("abc", 2**63))),
        "string_len_over_limit": with_kv(kv("x", VT.STRING, gstr("abc", 2**26 + 1))),
        "uint64_value_past_eof": gguf_file([*base_kvs(), kv("x", VT.UINT64, b"\x00" * 4)], []),
        # The file that makes gguf.GGUFReader loop for ever: one array of 2**63 uint8.
        "array_len_2pow63": gguf_file([kv("a", VT.ARRAY, u32(VT.UINT8) + u64(2**63))], []),
        "array_len_huge_uint32": with_kv(kv("x", VT.ARRAY, u32(VT.UINT32) + u64(2**40))),
        "array_over_element_limit": with_kv(kv("x", VT.ARRAY, u32(VT.UINT8) + u64(2**23 + 1))),
        "array_of_strings_len_huge": with_kv(kv("x", VT.ARRAY, u32(VT.STRING) + u64(2**62))),
        "array_string_past_eof": with_kv(
            kv("x", VT.ARRAY, u32(VT.STRING) + u64(2) + gstr("a") + gstr("b", 10**6))),
        "array_string_len_huge": with_kv(
            kv("x", VT.ARRAY, u32(VT.STRING) + u64(2) + gstr("a") + gstr("b", 2**64 - 1))),
        "nested_array": with_kv(
            kv("x", VT.ARRAY, u32(VT.ARRAY) + u64(1) + u32(VT.UINT8) + u64(1) + b"\x01")),
        # Deep enough to make a recursive reader raise RecursionError.
        "nested_array_deep": with_kv(
            kv("x", VT.ARRAY, (u32(VT.ARRAY) + u64(1)) * 5000 + u32(VT.UINT8) + u64(0))),
        "array_elem_type_13": with_kv(kv("x", VT.ARRAY, u32(13) + u64(1) + b"\x00" * 8)),
        "array_elem_type_huge": with_kv(kv("x", VT.ARRAY, u32(2**32 - 1) + u64(1) + bytes(8))),
    }


def _alignment_cases() -> dict[str, bytes]:
    def align_file(vtype: int, payload: bytes) -> bytes:
        infos, data = base_infos()
        return gguf_file(base_kvs(kv("general.alignment", vtype, payload)), infos, data)

    cases = {f"alignment_{a}": align_file(VT.UINT32, u32(a)) for a in (0, 4, 13, 48, 2**30)}
    cases["alignment_float32"] = align_file(VT.FLOAT32, struct.pack("<f", 32.0))
    cases["alignment_uint64"] = align_file(VT.UINT64, u64(32))
    cases["alignment_int32"] = align_file(VT.INT32, struct.pack("<i", 32))
    cases["alignment_string"] = align_file(VT.STRING, gstr("32"))
    return cases


def _tensor_cases() -> dict[str, bytes]:
    def b(ne: Sequence[int], qtype: int = QT.F32, offset: int = 32, name: str | bytes = "b.weight",
          n_dims: int | None = None) -> bytes:  # replaces b.weight (F16 (8,) at offset 32)
        return with_info("b.weight", tensor_info(name, ne, qtype, offset, n_dims))

    def c(ne: Sequence[int], qtype: int = QT.Q8_0, offset: int = 64) -> bytes:
        return with_info("c.weight", tensor_info("c.weight", ne, qtype, offset))  # at 64

    return {
        "tensor_name_len_huge": with_info("b.weight", gstr("b", 2**64 - 1)),
        "tensor_name_empty": b((8,), name=""),
        "tensor_name_not_utf8": b((8,), name=b"\xc3\x28"),
        "tensor_name_duplicate": b((8,), name="a.weight"),
        "n_dims_0": b(()),
        "n_dims_5": b((1, 1, 1, 1, 8)),
        "n_dims_huge": b((8,), n_dims=2**32 - 1),
        "dim_zero": b((8, 0)),
        "dims_product_overflow": b((2**32, 2**32, 2**32)),
        "dim_2pow63": b((2**63,)),
        "dims_product_2pow63": b((2**62, 2)),
        "unknown_ggml_type_99": b((8,), 99),
        "unknown_ggml_type_4_removed_q4_2": b((32,), 4),
        "unknown_ggml_type_huge": b((8,), 2**32 - 1),
        "block_size_q8_0_row_33": c((33, 2)),
        "block_size_q4_k_row_32": c((32, 2), QT.Q4_K),
        "offset_misaligned": b((8,), QT.F16, offset=33),
        "offset_past_eof": c((32, 2), offset=2**20),
        "offset_huge": c((32, 2), offset=2**64 - 32),
        "size_past_eof": c((32, 4096)),
        "size_huge_f64": c((2**31, 2**31), QT.F64),
    }


def truncations(data: bytes, n: int = NUM_TRUNCATIONS, seed: int = 0) -> dict[str, bytes]:
    """`data` cut at n distinct random points (a valid file has no trailing padding, so
    every cut loses something the header promises)."""
    points = sorted(random.Random(seed).sample(range(1, len(data)), n))
    return {f"truncated_at_{p}": data[:p] for p in points}


def bad_cases() -> list[tuple[str, bytes]]:
    cases = {**_header_cases(), **_kv_cases(), **_alignment_cases(), **_tensor_cases(),
             **truncations(valid_file())}
    return list(cases.items())


def expected_error(name: str) -> type[EngineError]:
    return UnsupportedTensorType if name.startswith("unknown_ggml_type") else GGUFFormatError
