"""bench/gpu/mlp_read_bench.py in the interpreter (tiny shapes, --smoke): every variant
reads exactly the words a fused MLP program would (its xor against numpy's), for both
down types and a slice of a super-block and a whole one."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the CPU torch build has no Triton")

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "mlp_read_bench.py"


def test_smoke_reads_agree(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--f", "64,256", "--warps",
                          "4", "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "mlp_read_bench.json").read_text())["rows"]
    assert [r["down"] for r in rows] == ["Q4_K", "Q6_K"]
    for r in rows:
        assert set(r["variants"]) == {"F64_w4", "F256_w4"}
        assert all(v["ok"] is True and v["us"] > 0 for v in r["variants"].values())
        assert r["variants"]["F64_w4"]["programs"] == 16  # 1024 FFN columns, 64 a program
        assert r["flat_one"]["us"] > 0 and r["flat_two"]["us"] > 0


def test_rejects_other_slices(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--f", "96", "--out",
                          str(tmp_path)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 1 and "--f: 64, 128 or 256" in run.stdout


@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx1151"])
@pytest.mark.parametrize("f,q6", [(64, False), (256, True)])
def test_read_kernel_builds(target, f, q6):
    """The read kernel compiles for the lent GPU and the appliance's chip without spills."""
    sys.path[:0] = [str(SCRIPT.parent)]
    try:
        import mlp_read_bench
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from kernels import aot

    sig = {"gu_ptr": "*u8", "dn_ptr": "*u8", "gu_out": "*i32", "dn_out": "*i32", "ffn": "i32",
           "hidden": "i32", "dn_row_words": "i32"}
    consts = {"F": f, "Q6": q6, "RCH": 32, "DCH": 128}
    spec = aot.KernelSpec("mlp_read", mlp_read_bench._read_mlp,
                          {**sig, **{k: "constexpr" for k in consts}}, consts, 8, False,
                          divisible=("gu_ptr", "dn_ptr", "gu_out", "dn_out"))
    kernel = aot.build(spec, target)
    info = aot.check_asm(spec, target, kernel)
    assert not info["problems"], info
