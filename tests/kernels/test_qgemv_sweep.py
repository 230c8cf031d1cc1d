"""bench/gpu/qgemv_sweep.py's logic at a tiny shape on the CPU (--smoke, interpreter,
without gguf-py as on the device machine), on a small grid. Started in the background
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
    run = background.result("qsweep")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((run.out_dir / "qgemv_sweep.json").read_text())


def test_every_config_checked_and_the_best_recorded(report):
    rows = report["rows"]
    assert {r["type"] for r in rows} == {"Q4_K", "Q6_K"}
    assert all(r["ok"] and r["err"] <= 2**-7 and r["us"] > 0 for r in rows)
    for t in ("Q4_K", "Q6_K"):
        m1 = [r for r in rows if r["type"] == t and r["m"] == 1]
        # the default first, then the grid's (block_k 128 / 256 where the type allows,
        # 64 x 4 tiles, two pipeline depths)
        assert sum(r["default"] for r in m1) == 1 and len(m1) >= 3
        assert {r["config"][2] for r in m1} >= {128}
        assert any(r["m"] == 16 for r in rows if r["type"] == t)
        for m in (1, 16):
            best = report["best"][f"{t} (64,256) M={m}"]
            assert best["best"] in [r["config"] for r in rows if r["type"] == t and r["m"] == m]
    assert report["commit"] and report["date"] and report["device"] == "cpu"
