"""Shared fixtures: the reference implementation's sdist (vocab files, test vectors) and the
embedded default model. Nothing here skips: a missing reference is a failure."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

LLAMA_CPP_VERSION = "0.3.36"
CACHE = Path(os.environ.get("MBUFO_TEST_CACHE", Path.home() / ".cache" / "mbufo-tests"))


def llama_cpp_source() -> Path:
    """The llama-cpp-python sdist, unpacked once into the test cache; returns vendor/llama.cpp.
    Under the cache's lock: the suite's worker processes (scripts/test.sh) start together,
    and one must not read the folder while another still downloads or unpacks it."""
    from engine.cache_files import locked

    CACHE.mkdir(parents=True, exist_ok=True)
    with locked(CACHE / f"llama_cpp_python-{LLAMA_CPP_VERSION}"):
        return _unpacked_source()


def _unpacked_source() -> Path:
    root = CACHE / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    vendor = root / "vendor" / "llama.cpp"
    if (vendor / "models").is_dir():
        return vendor
    tarball = CACHE / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz"
    if not tarball.exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--disable-pip-version-check", "-q", "-d", str(CACHE),
             f"llama-cpp-python=={LLAMA_CPP_VERSION}"],
            check=True,
        )
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers()
                   if "/vendor/llama.cpp/models/" in m.name or "/vendor/llama.cpp/src/" in m.name]
        tar.extractall(CACHE, members=members, filter="data")
    return vendor


@pytest.fixture(scope="session")
def llama_vendor() -> Path:
    return llama_cpp_source()


@pytest.fixture(scope="session")
def vocab_dir(llama_vendor: Path) -> Path:
    return llama_vendor / "models"


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from engine.loader import resolve_model_path

    return resolve_model_path("default")
