"""Fixtures of the kernel tests: the interpreter worker (kernel_worker.py) and the background
AOT build (aot_build.py), helpers importable in any pytest import mode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

from aot_build import start_aot_build  # noqa: E402
from kernel_worker import InterpreterWorker  # noqa: E402


@pytest.fixture(scope="session")
def interp() -> InterpreterWorker:
    """A process that imported Triton for its interpreter; kernels run there on CPU tensors."""
    worker = InterpreterWorker()
    yield worker
    worker.close()


AOT_TEST = "test_aot.py"


def pytest_collection_modifyitems(session, config, items) -> None:
    """The AOT build runs in a background process while the other tests run (see
    aot_build.py); its tests go last so that they wait as little as possible."""
    aot = [item for item in items if item.path.name == AOT_TEST
           and item.path.parent == Path(__file__).parent]
    if aot:
        items[:] = [item for item in items if item not in aot] + aot
        start_aot_build()
