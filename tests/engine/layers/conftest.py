"""The Triton interpreter worker of tests/kernels, with the engine's kernel switch forced to
`triton` in it, so engine layers run their kernel path on CPU tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_KERNEL_TESTS = Path(__file__).resolve().parents[2] / "kernels"
# the worker imports this directory's test modules by name (functions it runs for them)
for _dir in (_KERNEL_TESTS, Path(__file__).resolve().parent):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))

from kernel_worker import InterpreterWorker  # noqa: E402


@pytest.fixture(scope="session")
def triton_worker() -> InterpreterWorker:
    worker = InterpreterWorker()
    worker.call("engine.kernel_select:set_mode", "triton")
    yield worker
    worker.close()
