"""Numbers and layout shared by the benchmarks: percentiles, latency summaries, text tables.

Percentiles interpolate linearly between order statistics (numpy's default "linear"
method), so p95 of a short list is well defined and matches what users compute themselves.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation; NaN for no values."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def latency_ms(seconds: Sequence[float], digits: int = 2) -> dict[str, float | None]:
    """{"mean", "p95", "max"} in milliseconds of durations given in seconds (None if empty)."""
    if not seconds:
        return {"mean": None, "p95": None, "max": None}
    ms = [s * 1e3 for s in seconds]
    return {"mean": round(mean(ms), digits), "p95": round(percentile(ms, 95), digits),
            "max": round(max(ms), digits)}


def ms(seconds: float | None, digits: int = 2) -> float | None:
    return None if seconds is None else round(seconds * 1e3, digits)


def compact_json(obj: dict[str, Any]) -> str:
    """One line, no spaces: what `--json` prints."""
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:,.1f}"
    return str(value)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A plain right-aligned text table (first column left-aligned)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(row: Sequence[str]) -> str:
        first = row[0].ljust(widths[0])
        return "  ".join([first] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                   strict=True)])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(headers)), rule] + [line(r) for r in cells])


def flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: a nested result as one table column per leaf."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out
