"""ModelFile on valid files written by gguf.GGUFWriter (the framework's own encoder): metadata
and tensor bytes round-trip, and the fields agree with the stock gguf.GGUFReader."""

from __future__ import annotations

import os
import pathlib

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from engine.bench import gguf_cases as gc
from engine.errors import GGUFFormatError
from engine.gguf import ModelFile
from engine.gguf.reader import MappedReader

RNG = np.random.default_rng(0)
F32 = RNG.standard_normal((3, 5)).astype(np.float32)
F16 = RNG.standard_normal((2, 8)).astype(np.float16)
Q8_SRC = RNG.standard_normal((4, 64)).astype(np.float32)
Q8 = gguf.quants.quantize(Q8_SRC, QT.Q8_0)  # (4, 68) uint8 blocks
VOCAB = [f"tok{i}_é" for i in range(3000)]

SCALARS = [  # (key, GGUF type, value written, Python type expected)
    ("t.u8", VT.UINT8, 200, int), ("t.i8", VT.INT8, -100, int),
    ("t.u16", VT.UINT16, 60000, int), ("t.i16", VT.INT16, -30000, int),
    ("t.u32", VT.UINT32, 4_000_000_000, int), ("t.i32", VT.INT32, -2_000_000_000, int),
    ("t.u64", VT.UINT64, 2**63 + 5, int), ("t.i64", VT.INT64, -(2**62), int),
    ("t.f32", VT.FLOAT32, 0.1, float), ("t.f64", VT.FLOAT64, 0.1, float),
    ("t.bool", VT.BOOL, True, bool), ("t.str", VT.STRING, "héllo {{ x }}", str),
]
ARRAYS = [  # (key, element type, values, numpy dtype expected)
    ("a.i32", VT.INT32, [1, -2, 3], np.int32), ("a.u64", VT.UINT64, [2**64 - 1, 0], np.uint64),
    ("a.f32", VT.FLOAT32, [0.5, -1.25, 3e-7], np.float32), ("a.f64", VT.FLOAT64, [0.1], np.float64),
    ("a.u8", VT.UINT8, [0, 255], np.uint8), ("a.bool", VT.BOOL, [True, False, True], np.bool_),
]


def write_model(path: pathlib.Path, alignment: int | None = None) -> pathlib.Path:
    w = gguf.GGUFWriter(path, "tiny")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vtype, value, _ in SCALARS:
        w.add_key_value(key, value, vtype)
    for key, etype, values, _ in ARRAYS:
        w.add_key_value(key, values, VT.ARRAY, sub_type=etype)
    w.add_array("tokenizer.ggml.tokens", VOCAB)
    w.add_key_value("t.bad_utf8", b"ok\xff", VT.STRING)
    w.add_key_value("a.bad_utf8", [b"a", b"\xc3("], VT.ARRAY, sub_type=VT.STRING)
    w.add_uint32("tiny.block_count", 2)
    w.add_tensor("w.f32", F32)
    w.add_tensor("w.f16", F16)
    w.add_tensor("w.q8", Q8, raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_metadata_round_trips(model_path: pathlib.Path) -> None:
    with ModelFile.open(model_path) as m:
        assert m.version == 3 and m.alignment == 32 and m.architecture == "tiny"
        for key, vtype, value, kind in SCALARS:
            got = m.require(key, kind)
            assert type(got) is kind, key
            expected = float(np.float32(value)) if vtype == VT.FLOAT32 else value
            assert got == expected, key
        for key, _, values, dtype in ARRAYS:
            got = m.require(key, np.ndarray)
            assert got.dtype == dtype and got.flags.owndata, key
            np.testing.assert_array_equal(got, np.array(values, dtype=dtype), err_msg=key)
        assert m.get("tokenizer.ggml.tokens") == VOCAB
        assert m.get("t.bad_utf8") == "ok\ufffd"
        assert m.get("a.bad_utf8") == ["a", "\ufffd("]
        assert m.arch_require("block_count", int) == 2 and m.arch_get("nope", 7) == 7


def test_tensors_round_trip(model_path: pathlib.Path) -> None:
    with ModelFile.open(model_path) as m:
        assert list(m.tensors) == ["w.f32", "w.f16", "w.q8"]
        for name, arr, qtype, shape in [("w.f32", F32, QT.F32, (3, 5)),
                                        ("w.f16", F16, QT.F16, (2, 8)),
                                        ("w.q8", Q8, QT.Q8_0, (4, 64))]:
            info = m.tensors[name]
            assert (info.ggml_type, info.shape) == (qtype, shape)
            assert info.n_elements == int(np.prod(shape)) and info.n_bytes == arr.nbytes
            assert info.offset % m.alignment == 0
            raw = m.tensor_data(name)
            assert raw.dtype == np.uint8 and raw.ndim == 1 and not raw.flags.writeable
            assert not raw.flags.owndata  # a view on the mapping, not a copy
            assert raw.tobytes() == arr.tobytes()
            with open(model_path, "rb") as f:  # the offset is absolute in the file
                f.seek(info.offset)
                assert f.read(info.n_bytes) == arr.tobytes()
        deq = gguf.quants.dequantize(m.tensor_data("w.q8").reshape(4, 68), QT.Q8_0)
        np.testing.assert_allclose(deq, Q8_SRC, atol=0.05)


def test_fields_agree_with_stock_reader(model_path: pathlib.Path) -> None:
    """MappedReader changes how gguf.GGUFReader fetches bytes, not what it builds."""
    stock, fast = gguf.GGUFReader(model_path, "r"), MappedReader(model_path, "r")
    assert list(stock.fields) == list(fast.fields)
    for key, a in stock.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.name, a.data, a.types) == (b.offset, b.name, b.data, b.types), key
        assert len(a.parts) == len(b.parts), key
        for pa, pb in zip(a.parts, b.parts, strict=True):
            assert pa.dtype == pb.dtype and pa.shape == pb.shape, key
            assert pa.tobytes() == pb.tobytes(), key
    assert stock.data_offset == fast.data_offset
    for ta, tb in zip(stock.tensors, fast.tensors, strict=True):
        assert (ta.name, ta.tensor_type, ta.n_bytes, ta.data_offset) == (
            tb.name, tb.tensor_type, tb.n_bytes, tb.data_offset)
        np.testing.assert_array_equal(ta.data, tb.data)
    m = ModelFile.open(model_path)
    for key in ("tokenizer.ggml.tokens", "a.i32", "a.f32", "t.f32", "t.u64", "t.str"):
        expected = stock.fields[key].contents()
        got = m.metadata[key]
        assert (got.tolist() if isinstance(got, np.ndarray) else got) == expected, key


def test_custom_alignment(tmp_path: pathlib.Path) -> None:
    with ModelFile.open(write_model(tmp_path / "a64.gguf", alignment=64)) as m:
        assert m.alignment == 64
        assert all(t.offset % 64 == 0 for t in m.tensors.values())
        assert m.tensor_data("w.f32").tobytes() == F32.tobytes()


def test_crafted_valid_variants_open(tmp_path: pathlib.Path) -> None:
    """The byte encoder of the bad cases makes files the stock reader accepts; version 2,
    empty arrays and tensor-less files are valid too."""
    empty = [gc.kv("e.u16", VT.ARRAY, gc.u32(VT.UINT16) + gc.u64(0)),
             gc.kv("e.str", VT.ARRAY, gc.u32(VT.STRING) + gc.u64(0))]
    infos, data = gc.base_infos()
    files = {"base": gc.valid_file(), "v2": gc.gguf_file(gc.base_kvs(), infos, data, version=2),
             "empty_arrays": gc.gguf_file([*gc.base_kvs(), *empty], infos, data),
             "no_tensors": gc.gguf_file(gc.base_kvs(), [])}
    for name, blob in files.items():
        path = tmp_path / name
        path.write_bytes(blob)
        stock = gguf.GGUFReader(path, "r")
        with ModelFile.open(path) as m:
            assert len(m.tensors) == len(stock.tensors), name
            assert m.get("tokenizer.ggml.tokens") == ["<s>", "a", "bc"], name
            for t in stock.tensors:
                assert m.tensor_data(t.name).tobytes() == t.data.tobytes(), name
            if name == "empty_arrays":
                assert m.get("e.u16").dtype == np.uint16 and m.get("e.u16").size == 0
                assert m.get("e.str") == []


def test_require_errors_name_the_key(model_path: pathlib.Path) -> None:
    m = ModelFile.open(model_path)
    with pytest.raises(GGUFFormatError, match="'t.missing'"):
        m.require("t.missing")
    with pytest.raises(GGUFFormatError, match="'t.str' must be int"):
        m.require("t.str", int)
    with pytest.raises(GGUFFormatError, match="'t.bool' must be int"):
        m.require("t.bool", int)  # a bool is not a count
    assert m.require("t.u32", float) == 4_000_000_000  # an int is accepted as a float
    assert m.require("t.bool", (bool, int)) is True
    with pytest.raises(GGUFFormatError, match="'tiny.nope'"):
        m.arch_require("nope", int)
    with pytest.raises(GGUFFormatError, match="'w.nope'"):
        m.tensor_data("w.nope")
    m.close()
    with pytest.raises(GGUFFormatError, match="closed"):
        m.tensor_data("w.f32")


def test_architecture_missing_or_not_a_string(tmp_path: pathlib.Path) -> None:
    kvs = [gc.kv("general.architecture", VT.UINT32, gc.u32(1))]
    for name, blob in {"missing": gc.gguf_file([], []), "number": gc.gguf_file(kvs, [])}.items():
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(GGUFFormatError, match="general.architecture"):
            _ = ModelFile.open(tmp_path / name).architecture


def test_missing_file_is_model_not_found(tmp_path: pathlib.Path) -> None:
    from engine.errors import ModelNotFound

    with pytest.raises(ModelNotFound):
        ModelFile.open(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFound):
        ModelFile.open(tmp_path)
    os.mkfifo(tmp_path / "fifo.gguf")  # must not block waiting for a writer
    with pytest.raises(ModelNotFound, match="not a regular file"):
        ModelFile.open(tmp_path / "fifo.gguf")
