"""Runs Triton kernels on CPU tensors in a worker process started for the interpreter.

Triton builds its own library functions (tl.zeros, tl.sum, ...) for the interpreter only
when TRITON_INTERPRET=1 is set as it is imported, and a process built that way cannot
compile kernels. The test process stays a normal one (the AOT tests compile there) and
sends kernel calls to a spawned worker whose environment has the variable set before
anything imports Triton.

Inside the worker every float tensor made by torch.empty/empty_like is filled with NaN,
so outputs and intermediate buffers that a kernel fails to write show up as NaN.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Any


def _init() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.set_num_threads(1)
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.dtype.is_floating_point else t

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))


def _run(target: str, args: tuple, kwargs: dict) -> Any:
    from kernels.triton_util import interpreter_active

    assert interpreter_active(), "the worker must import Triton for the interpreter"
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)(*args, **kwargs)


class InterpreterWorker:
    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_init)

    def call(self, target: str, *args: Any, **kwargs: Any) -> Any:
        """`module:function` called in the worker with (pickled) arguments."""
        return self._pool.submit(_run, target, args, kwargs).result(timeout=300)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
