"""Slow subprocess checks started in the background as soon as their tests are collected
and awaited by them, so that they overlap the interpreter tests:

- "aot": `python -m kernels.aot --quick`, every kernel built for both targets (about a
  minute of one core when Triton's cache is cold), without TRITON_INTERPRET;
- "smoke": bench/gpu/kernels_check.py --smoke under TRITON_INTERPRET=1 with gguf-py made
  unimportable, as on the device machine;
- "qbench": bench/gpu/qmatmul_bench.py --smoke (two types) the same way;
- "qvariants": bench/gpu/qgemv_variants.py --smoke the same way, this tree's kernels
  against copies of themselves as the "earlier version";
- "qsweep": bench/gpu/qgemv_sweep.py --smoke the same way, on a small grid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "kernels_check.py"
QBENCH = ROOT / "bench" / "gpu" / "qmatmul_bench.py"
QVARIANTS = ROOT / "bench" / "gpu" / "qgemv_variants.py"
QSWEEP = ROOT / "bench" / "gpu" / "qgemv_sweep.py"
# Runs the script as __main__ with `import gguf` raising ImportError.
_NO_GGUF = ("import runpy, sys; sys.modules['gguf'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str
    out_dir: Path


_jobs: dict[str, dict[str, Any]] = {}


def _command(name: str, out_dir: Path) -> tuple[list[str], dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if name == "aot":
        return [sys.executable, "-m", "kernels.aot", "--quick"], env
    assert name in ("smoke", "qbench", "qvariants", "qsweep"), name
    env["TRITON_INTERPRET"] = "1"
    script, extra = {"smoke": (SCRIPT, []), "qbench": (QBENCH, ["--types", "Q4_K,Q6_K"]),
                     "qvariants": (QVARIANTS, ["--types", "Q4_K,Q6_K", "--old-src",
                                               str(_old_kernels(out_dir))]),
                     "qsweep": (QSWEEP, ["--types", "Q4_K,Q6_K", "--grid",
                                         "bk=128,256;tiles=64x4;st=0,2"])}[name]
    return [sys.executable, "-c", _NO_GGUF, str(script), "--smoke", "--out", str(out_dir),
            *extra], env


def _old_kernels(out_dir: Path) -> Path:
    """Copies of the qmatmul kernel files, as qgemv_variants' `--old-src` reads them."""
    old = out_dir / "old"
    old.mkdir()
    for f in ("qmatmul.py", "qtiles.py", "qgemv.py", "qscaled.py"):
        (old / f).write_text((ROOT / "kernels" / f).read_text())
    return old


def start(name: str) -> None:
    if name in _jobs:
        return
    out_dir = Path(tempfile.mkdtemp(prefix=f"mbufo-{name}-"))
    cmd, env = _command(name, out_dir)
    stdout, stderr = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=ROOT)
    _jobs[name] = {"proc": proc, "stdout": stdout, "stderr": stderr, "out_dir": out_dir}


def result(name: str, timeout: float = 900) -> Result:
    start(name)
    job = _jobs[name]
    job["proc"].wait(timeout=timeout)
    texts = []
    for stream in (job["stdout"], job["stderr"]):
        stream.seek(0)
        texts.append(stream.read().decode(errors="replace"))
    return Result(job["proc"].returncode, texts[0], texts[1], job["out_dir"])


def last_json(text: str) -> Any:
    """The JSON object on the last line of `text`, or None."""
    try:
        return json.loads(text.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return None
