"""The ahead-of-time build of every kernel (`python -m kernels.aot --quick`), started in a
background process as soon as the AOT tests are collected and awaited by them.

It needs a process that did not import Triton for the interpreter, so TRITON_INTERPRET is
removed from its environment. Compiling every kernel for two targets takes tens of
seconds on one core; the interpreter tests run meanwhile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any

_build: dict[str, Any] = {}


def start_aot_build() -> None:
    if _build:
        return
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, "-m", "kernels.aot", "--quick"], stdout=out,
                            stderr=err, env=env)
    _build.update(proc=proc, out=out, err=err)


def aot_result(timeout: float = 600) -> tuple[int, dict[str, Any] | None, str]:
    """(exit code, parsed JSON report or None, stderr tail) of the background build."""
    start_aot_build()
    proc = _build["proc"]
    proc.wait(timeout=timeout)
    _build["out"].seek(0)
    _build["err"].seek(0)
    text = _build["out"].read().decode()
    log = _build["err"].read().decode()[-4000:]
    try:
        report = json.loads(text.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        report = None
    return proc.returncode, report, log
