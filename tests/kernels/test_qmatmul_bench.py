"""bench/gpu/qmatmul_bench.py's logic at tiny shapes on the CPU (--smoke, interpreter, two
types), run the way the device machine runs it: without gguf-py. Started in the background
(background.py)."""

from __future__ import annotations

import ast
import importlib.util
import json
import re

import background
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the CPU torch build has no Triton")


@pytest.fixture(scope="module")
def smoke() -> dict:
    run = background.result("qbench")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"report": json.loads((run.out_dir / "qmatmul_bench.json").read_text()),
            "stdout": run.stdout}


def test_every_variant_is_checked_and_timed(smoke):
    rows = smoke["report"]["rows"]
    mine = [r for r in rows if "cfg" in r]
    assert {r["type"] for r in mine} == {"Q4_K", "Q6_K"}
    assert {r["m"] for r in mine} == {1, 4, 17}
    assert {r["kind"] for r in mine} == {"skinny", "tiled", "fma"}
    assert {r["m"] for r in mine if r["kind"] == "fma"} == {1, 4}
    assert all(r["ok"] and r["us"] > 0 and r["max_err_over_bound"] <= 2**-7 for r in mine)
    assert all(r["bits_equal_m1"] is True for r in mine if r["m"] > 1)
    assert any(r["kind"] == "torch_bf16" for r in rows)
    # The previous kernel runs from git where the history is there (else it is recorded).
    errors = [e for e in smoke["report"]["errors"] if not e.startswith("old kernel")]
    assert not errors and not smoke["report"]["skipped"]


def test_prints_the_config_tables_as_python(smoke):
    """The dicts printed last parse as Python and carry the keys kernels/qgemv.py reads."""
    out = smoke["stdout"]
    assert "correctness failures: 0;" in out
    tables = {name: ast.literal_eval(body) for name, body in
              re.findall(r"^(K_PLANS|SKINNY_TILES|TILED_TILES) = (\{.*?^\})", out, re.S | re.M)}
    assert set(tables) == {"K_PLANS", "SKINNY_TILES", "TILED_TILES"}
    assert set(tables["K_PLANS"]) == {("cuda", 12, 64, 512), ("cuda", 14, 64, 512)}
    for (backend, qtype, m, n, k), (block_n, warps, stages) in tables["SKINNY_TILES"].items():
        assert (backend, n, k) == ("cuda", 64, 512) and qtype in (12, 14) and m in (1, 4)
        assert block_n >= 16 and warps >= 1 and stages in (None, 2, 3, 4)
    assert all(len(v) == 4 for v in tables["TILED_TILES"].values())
