"""Model registry on tiny GGUFs written by gguf.GGUFWriter and on the default model; the
expected architecture and file type come from gguf.GGUFReader, hashes from hashlib."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest

from appliance.db import Database, StateError
from appliance.registry import ModelRecord, ModelRegistry
from engine.errors import GGUFFormatError, ModelNotFound


def reference(path: Path) -> tuple[str, int | None, str, int]:
    """(architecture, general.file_type, sha256, size) read without our code."""
    reader = gguf.GGUFReader(path, "r")
    arch = reader.fields["general.architecture"].contents()
    ftype = reader.fields.get("general.file_type")
    data = path.read_bytes()
    return arch, None if ftype is None else ftype.contents(), hashlib.sha256(data).hexdigest(), \
        len(data)


def test_add_list_get_remove(db: Database, tiny_gguf: Callable[..., Path]) -> None:
    path = tiny_gguf()
    arch, ftype, digest, size = reference(path)
    registry = ModelRegistry(db)
    record = registry.add(str(path), sessions=2, context=64, kv_quant="q8")
    assert isinstance(record, ModelRecord)
    assert (record.name, record.path, record.architecture, record.sha256, record.size_bytes) \
        == ("tiny-llama", str(path.resolve()), arch, digest, size)
    assert arch == "llama"
    assert record.file_type == gguf.LlamaFileType(ftype).name.removeprefix("MOSTLY_") == "Q8_0"
    assert (record.sessions, record.context, record.kv_quant) == (2, 64, "q8")
    assert registry.get("tiny-llama") == record
    other = registry.add(str(path), name="copy")
    assert (other.sessions, other.context, other.kv_quant) == (None, None, None)
    assert [r.name for r in registry.list()] == ["copy", "tiny-llama"]
    assert registry.remove("tiny-llama") is True
    assert registry.remove("tiny-llama") is False
    assert registry.get("tiny-llama") is None
    assert path.exists()  # the file is never deleted


def test_file_type_without_metadata_is_the_common_matrix_type(
        db: Database, tiny_gguf: Callable[..., Path]) -> None:
    record = ModelRegistry(db).add(str(tiny_gguf("plain.gguf", file_type=None)))
    assert record.file_type == "F16"  # two F16 matrices, one F32 norm vector


def test_duplicate_names_are_409(db: Database, tiny_gguf: Callable[..., Path]) -> None:
    registry = ModelRegistry(db)
    registry.add(str(tiny_gguf()), name="m")
    with pytest.raises(StateError) as err:
        registry.add(str(tiny_gguf("second.gguf")), name="m")
    assert (err.value.status, err.value.code) == (409, "model_exists")
    assert len(registry.list()) == 1


def test_bad_files_raise_typed_errors(db: Database, tmp_path: Path,
                                      tiny_gguf: Callable[..., Path]) -> None:
    registry = ModelRegistry(db)
    with pytest.raises(ModelNotFound):
        registry.add(str(tmp_path / "missing.gguf"))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(GGUFFormatError):
        registry.add(str(garbage))
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf().read_bytes()[:100])
    with pytest.raises(GGUFFormatError):
        registry.add(str(truncated))
    assert registry.list() == []


@pytest.mark.parametrize("kwargs", [
    {"sessions": 0}, {"context": -1}, {"kv_quant": "q5"}, {"name": ""}, {"name": "a b"},
    {"name": "-x"}, {"name": "x" * 129}])
def test_bad_defaults_and_names_are_refused(db: Database, tiny_gguf: Callable[..., Path],
                                            kwargs: dict) -> None:
    with pytest.raises(StateError):
        ModelRegistry(db).add(str(tiny_gguf()), **kwargs)


def test_default_model(db: Database, default_model_path: Path) -> None:
    # The embedded model is Gemma 3 270M Q4_K_M (its package says so); gguf.GGUFReader
    # would take half a minute on its 262k-token vocabulary, so the facts are spelled out.
    data = default_model_path.read_bytes()
    record = ModelRegistry(db).add("default")
    assert (record.name, record.path) == ("default", str(default_model_path.resolve()))
    assert (record.architecture, record.file_type) == ("gemma3", "Q4_K_M")
    assert (record.sha256, record.size_bytes) == (hashlib.sha256(data).hexdigest(), len(data))
