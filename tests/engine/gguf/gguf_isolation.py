"""Run GGUF opens in a fresh interpreter that imports only engine.gguf, one fork per job, each
with its own address-space cap (RLIMIT_AS) and wall-clock limit.

One interpreter start (~1 s with numpy and gguf) serves every job: the runner forks a child
per job, the child sets its limits and reports `{"error": class name, "message": ...}` or
`{"ok": true}` as JSON through a pipe; the runner kills a child that outlives the limit
("Timeout") and reports a child killed by a signal ("Signal<N>").
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]
MEMORY_LIMIT = 256 << 20
TIME_LIMIT_S = 10.0

RUNNER = r"""
import json, math, os, resource, select, signal, sys, time
import engine.gguf
from engine.gguf import ModelFile

MEM, TIMEOUT = int(sys.argv[1]), float(sys.argv[2])
print(json.dumps({"torch_imported": "torch" in sys.modules,
                  "vm_kib": int(open("/proc/self/status").read().split("VmSize:")[1].split()[0])}),
      flush=True)  # before any fork: a child must not inherit (and print) it again

def work(kind, arg):
    if kind == "open":
        with ModelFile.open(arg) as m:
            return {"ok": True, "num_tensors": len(m.tensors)}
    if kind == "stock":
        import gguf
        return {"ok": True, "num_tensors": len(gguf.GGUFReader(arg, "r").tensors)}
    if kind == "alloc":
        import numpy as np
        return {"ok": True, "sum": int(np.ones(int(arg), np.uint8).sum())}
    if kind == "sleep":
        time.sleep(float(arg))
        return {"ok": True}
    raise ValueError(kind)

def child(job, w):
    try:
        resource.setrlimit(resource.RLIMIT_AS, (MEM, MEM))
        cpu = math.ceil(TIMEOUT) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        err = None
        try:
            res = work(*job.split(":", 1))
        except BaseException as e:
            err = e  # no allocation here: the job may have used up the address space
        if err is not None:
            # drop the failed job's frames (and what they hold) before building the report
            err.__traceback__ = err.__context__ = err.__cause__ = None
            res = {"error": type(err).__name__, "message": str(err)[:2000]}
        os.write(w, json.dumps(res).encode())
    finally:
        os._exit(0)  # never back into the runner's loop, whatever happened

for job in sys.argv[3:]:
    r, w = os.pipe()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child(job, w)
    os.close(w)
    chunks, deadline, res = [], start + TIMEOUT, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            os.kill(pid, signal.SIGKILL)
            res = {"error": "Timeout", "message": f"no answer within {TIMEOUT} s"}
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(r)
    _, status, usage = os.wait4(pid, 0)
    if res is None:
        if chunks:
            res = json.loads(b"".join(chunks))
        else:
            res = {"error": f"Signal{os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"Exit{os.WEXITSTATUS(status)}", "message": "no report"}
    res.update(job=job, elapsed_s=time.monotonic() - start, maxrss_kib=usage.ru_maxrss)
    print(json.dumps(res), flush=True)
"""


def run_isolated(jobs: list[str], time_limit_s: float = TIME_LIMIT_S,
                 memory_limit: int = MEMORY_LIMIT) -> tuple[dict, list[dict]]:
    """Jobs are "open:<path>", "stock:<path>" (gguf.GGUFReader alone), "alloc:<bytes>",
    "sleep:<s>". Returns the runner's header (torch_imported, vm_kib) and one dict per job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "OPENBLAS", "OMP"))}
    # Many BLAS threads each reserve address space; one keeps the child under the cap.
    env.update(PYTHONPATH=str(REPO_ROOT), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(memory_limit), str(time_limit_s), *jobs],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True,
        timeout=60 + len(jobs) * (time_limit_s + 1))
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or len(lines) != len(jobs) + 1:
        raise RuntimeError(f"runner failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return lines[0], lines[1:]
