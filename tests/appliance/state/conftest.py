"""Fixtures of the state tests: a migrated database per test (copied from one migrated
template, so each test does not pay for the migration), a fake clock, tiny GGUF files."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest

from appliance.db import Database, open_database
from appliance.settings import Settings


class FakeClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="session")
def migrated_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    data_dir = tmp_path_factory.mktemp("template") / "data"
    open_database(Settings(data_dir=data_dir)).close()
    return data_dir / "mbufo.db"


@pytest.fixture
def settings(tmp_path: Path, migrated_template: Path) -> Settings:
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    shutil.copyfile(migrated_template, data_dir / "mbufo.db")
    return Settings(data_dir=data_dir)


@pytest.fixture
def db(settings: Settings) -> Iterator[Database]:
    database = open_database(settings)
    yield database
    database.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def write_gguf(path: Path, *, file_type: int | None = int(gguf.LlamaFileType.MOSTLY_Q8_0),
               architecture: str = "llama") -> Path:
    """A tiny GGUF written by gguf.GGUFWriter: a few llama metadata keys, three tensors."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test model")
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_head_count(2)
    if file_type is not None:
        writer.add_file_type(file_type)
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", rng.standard_normal((16, 32)).astype(np.float16))
    writer.add_tensor("output.weight", rng.standard_normal((16, 32)).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Callable[..., Path]:
    def make(name: str = "tiny-llama.gguf", **kwargs) -> Path:
        return write_gguf(tmp_path / name, **kwargs)
    return make
