"""How fast and how cheaply the GGUF loader rejects malformed files (`mbufo bench gguf-reject`).

Every case of `gguf_cases.bad_cases()` is written to a temporary file and opened in this
process with `ModelFile.open`, the path a user's file takes. Reported: the typical (median)
and worst rejection time, the growth of this process's peak RSS over the run, and the
largest Python/numpy allocation peak of one rejection (tracemalloc, in a second pass so that
tracing does not slow the timed one). A case that is accepted, or rejected with the wrong
error class, is listed under `failures`.
"""

from __future__ import annotations

import resource
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from engine.bench.gguf_cases import bad_cases, expected_error
from engine.errors import EngineError
from engine.gguf import ModelFile


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _reject(path: Path, name: str) -> str | None:
    """None if the file is rejected as expected, else what went wrong."""
    try:
        ModelFile.open(path).close()
    except EngineError as e:
        if isinstance(e, expected_error(name)):
            return None
        return f"{type(e).__name__} instead of {expected_error(name).__name__}: {e}"
    except Exception as e:  # an untyped error is exactly what this measures
        return f"untyped {type(e).__name__}: {e}"
    return "accepted"


def run_gguf_reject_bench(repeats: int = 5) -> dict[str, Any]:
    """Each case is timed `repeats` times (best of, to drop scheduler noise)."""
    cases = bad_cases()
    failures: dict[str, str] = {}
    best_ms: dict[str, float] = {}
    peak_alloc: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="mbufo-gguf-reject-") as tmp:
        paths = {}
        for name, data in cases:
            paths[name] = Path(tmp) / f"{name}.gguf"
            paths[name].write_bytes(data)
        rss_before = _peak_rss_bytes()
        for name, path in paths.items():
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                problem = _reject(path, name)
                times.append((time.perf_counter() - start) * 1e3)
                if problem is not None:
                    failures[name] = problem
            best_ms[name] = min(times)
        rss_growth = _peak_rss_bytes() - rss_before
        tracemalloc.start()
        try:
            for name, path in paths.items():
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
                _reject(path, name)
                peak_alloc[name] = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
    slowest = max(best_ms, key=best_ms.__getitem__)
    hungriest = max(peak_alloc, key=peak_alloc.__getitem__)
    return {
        "num_cases": len(cases),
        "num_rejected": len(cases) - len(failures),
        "median_ms": round(statistics.median(best_ms.values()), 4),
        "max_ms": round(best_ms[slowest], 4),
        "slowest_case": slowest,
        "peak_rss_growth_kib": rss_growth // 1024,
        "max_alloc_peak_kib": round(peak_alloc[hungriest] / 1024, 1),
        "max_alloc_case": hungriest,
        "failures": failures,
    }
