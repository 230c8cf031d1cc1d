"""Server test fixtures: a tiny synthetic GGUF (llama family, a real SPM vocabulary) and
one event loop per module. Helpers live in server_harness.py, importable in any pytest
import mode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from server_harness import TINY_SPEC  # noqa: E402

from engine.synthetic import write_synthetic_gguf  # noqa: E402


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, vocab_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_synthetic_gguf(path, TINY_SPEC, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=7)
    return path


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"  # module scope: one event loop for a module's fixtures and tests
