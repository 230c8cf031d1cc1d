"""bench/gpu/kernels_check.py's logic at tiny shapes on the CPU (--smoke, interpreter), run
the way the device machine runs it: without gguf-py. Started in the background
(background.py)."""

from __future__ import annotations

import ast
import importlib.util
import json

import background
import pytest
from gguf import GGMLQuantizationType

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the CPU torch build has no Triton")


@pytest.fixture(scope="module")
def smoke() -> dict:
    run = background.result("smoke")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"report": json.loads((run.out_dir / "kernels.json").read_text()),
            "stdout": run.stdout}


def test_smoke_checks_pass_and_cover_every_type(smoke):
    report = smoke["report"]
    checks = report["qmatmul_check"]
    assert {c["type"] for c in checks} == {"Q8_0", "Q4_K", "Q6_K", "Q4_0", "Q5_0", "Q5_K",
                                           "IQ4_XS", "MXFP4", "BF16"}
    assert all(c["ok"] and c["row0_bitequal_to_m1"] for c in checks)
    attention = report["attention_check"]
    assert attention and all(c["ok"] for c in attention)
    assert all(c["decode_row_bitequal_alone"] for c in attention if c["case"] == "mixed")
    assert not report["skipped"]


def test_smoke_times_and_prints_the_table(smoke):
    report = smoke["report"]
    assert report["qmatmul_bench"] and report["attention_bench"]
    assert any(r["config"] == "torch bf16" for r in report["qmatmul_bench"])
    assert all(r["us"] > 0 for r in report["qmatmul_bench"] + report["attention_bench"])
    assert smoke["stdout"].strip().splitlines()[-1].startswith("correctness failures: 0;")


def test_gguf_stand_in_has_gguf_values():
    """The script's stand-in for gguf-py's type enum (used on the device) matches it."""
    text = background.SCRIPT.read_text()
    start = text.index("GGML_TYPES = {")
    table = ast.literal_eval(text[start + len("GGML_TYPES = "):text.index("}", start) + 1])
    assert len(table) > 10
    for name, value in table.items():
        assert GGMLQuantizationType[name] == value, name
