"""Fixtures of the kernel tests: the interpreter worker (kernel_worker.py) and the background
checks (background.py), helpers importable in any pytest import mode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))

import background  # noqa: E402
from kernel_worker import InterpreterWorker  # noqa: E402


@pytest.fixture(scope="session")
def interp() -> InterpreterWorker:
    """A process that imported Triton for its interpreter; kernels run there on CPU tensors."""
    worker = InterpreterWorker()
    yield worker
    worker.close()


# Test file -> the background check it awaits.
BACKGROUND = {"test_aot.py": "aot", "test_kernels_check.py": "smoke",
              "test_qmatmul_bench.py": "qbench", "test_qgemv_variants.py": "qvariants",
              "test_qgemv_sweep.py": "qsweep"}


def pytest_collection_modifyitems(session, config, items) -> None:
    """Start the background checks whose tests were collected; their tests go last so
    that they wait as little as possible."""
    here = Path(__file__).parent
    late = [item for item in items if item.path.parent == here and item.path.name in BACKGROUND]
    if late:
        items[:] = [item for item in items if item not in late] + late
        for name in sorted({BACKGROUND[item.path.name] for item in late}):
            background.start(name)
