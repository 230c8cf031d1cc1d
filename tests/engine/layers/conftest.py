"""The Triton interpreter worker of tests/kernels, with the engine's kernel switch forced to
`triton` in it, so engine layers run their kernel path on CPU tensors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_KERNEL_TESTS = Path(__file__).resolve().parents[2] / "kernels"
if str(_KERNEL_TESTS) not in sys.path:
    sys.path.insert(0, str(_KERNEL_TESTS))

from kernel_worker import InterpreterWorker  # noqa: E402


@pytest.fixture(scope="session")
def triton_worker() -> InterpreterWorker:
    worker = InterpreterWorker()
    worker.call("engine.kernel_select:set_mode", "triton")
    yield worker
    worker.close()
