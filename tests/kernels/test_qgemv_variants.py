"""bench/gpu/qgemv_variants.py's logic at tiny shapes on the CPU (--smoke, interpreter,
without gguf-py as on the device machine): the kernels against an "earlier version" (here
copies of themselves, loaded through --old-src). Started in the background
(background.py)."""

from __future__ import annotations

import importlib.util
import json

import background
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the CPU torch build has no Triton")


@pytest.fixture(scope="module")
def report() -> dict:
    run = background.result("qvariants")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "failures (wrong or bits differ from M=1): 0;" in run.stdout
    return json.loads((run.out_dir / "qgemv_variants.json").read_text())


def test_both_versions_checked_at_every_row_count(report):
    rows = [r for r in report["rows"] if r["config"] is None]  # the default configs
    assert {(r["type"], r["mode"], r["m"]) for r in rows} == {
        (t, mode, m) for t in ("Q4_K", "Q6_K") for mode in ("old", "new")
        for m in (1, 16, 64, 512)}
    assert all(r["ok"] and r["us"] > 0 and r["err"] <= 2**-7 for r in rows)
    assert all(r["bits_equal_m1"] is True for r in rows)
    # a copy of the same kernels: the same bits as this tree's, row for row
    by_key = {(r["type"], r["m"], r["mode"]): r["err"] for r in rows}
    assert all(by_key[(t, m, "old")] == by_key[(t, m, "new")] for t, m, _ in by_key)


def test_sweeps_the_skinny_configs_and_records_the_run(report):
    swept = [r for r in report["rows"] if r["config"] is not None]
    assert {r["type"] for r in swept} == {"Q4_K", "Q6_K"} and all(r["ok"] for r in swept)
    assert all(r["m"] == 1 and r["mode"] == "new" for r in swept)
    assert report["commit"] and report["date"] and report["device"] == "cpu"
