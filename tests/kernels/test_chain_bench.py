"""bench/gpu/chain_bench.py: its persistent kernel's products bit-equal to qint's launches
(interpreted, tiny shapes, --smoke: no barrier, which needs every program running at once,
except in the dependent chain's one-program case),
and its barrier variants built for both targets (the grid barrier: a release count by one
thread of each program, acquire polls; and the tree's arrivals over group counters)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the CPU torch build has no Triton")

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"
SCRIPT = BENCH / "chain_bench.py"


def test_smoke_products_bit_equal(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "chain_bench.json").read_text())["rows"]
    assert [(r["n"], r["k"], r["dep"]) for r in rows] == [
        (16, 512, False), (48, 1024, False), (512, 512, False), (512, 512, True)]
    assert all(r["free_ok"] is True for r in rows[:3])
    assert rows[1]["programs"] == 2  # 48 rows in tiles of 32
    # each product's x the one before's output, quantized in the kernel between its
    # barriers (one program: the interpreter runs programs one after the other)
    assert rows[3]["prefetch_ok"] is True and rows[3]["programs"] == 1
    assert rows[3]["tree_ok"] is True  # the tree barrier's pass count, one group of one
    # the same products on qint's grid split, launched and chained by slice flags (the
    # dependent chain's x quantized by each block's last tile)
    # (64-row tiles: the first two shapes have one tile, which 2 slices cannot cut)
    assert all("flow_skipped" in r for r in rows[:2])
    for r in rows[2:]:
        assert r["grid_ok"] is True and r["flow_ok"] is True, r
        assert r["grid_config"][:2] == [64, 2] and r["grid_config"][6] is False  # not in_cta


def test_smoke_split_override(tmp_path):
    """--split S: every product at in_cta split S (64 / S weight rows a program), still
    bit-equal to qint's launches at that config; a split that does not divide is refused."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--split", "4", "--shapes",
                          "48x1024", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "chain_bench.json").read_text())["rows"]
    # the default there is split 2, 32 rows a program
    assert [r["config"][:2] for r in rows] == [[16, 4]] and rows[0]["free_ok"] is True
    assert rows[0]["programs"] == 3  # 48 rows, 16 a program
    bad = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--split", "3", "--shapes",
                          "48x1024", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 1 and "must divide" in bad.stdout


@pytest.mark.parametrize("target", ["cuda:90", "hip:gfx1151"])
@pytest.mark.parametrize("dep", [False, True])
def test_flow_variant_builds(target, dep):
    """The flow kernel: an acquire poll on its slice's flag, release counts of tiles (and
    with dep of blocks, after the block's quantization); no griddepcontrol.wait."""
    sys.path[:0] = [str(BENCH)]
    try:
        import chain_bench
    finally:
        sys.path.remove(str(BENCH))
    from kernels import aot

    cuda = target.startswith("cuda")
    sig = {"q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*i32", "w_ptr": "*u8",
           "y_ptr": "*fp32", "part_ptr": "*fp32", "ticket_ptr": "*i32", "done_ptr": "*i32",
           "blk_ptr": "*i32", "N": "i32", "K": "i32", "row_bytes": "i32",
           "sb_per_split": "i32", "nsplit": "i32", "layer": "i32", "tiles_per_slice": "i32",
           "dx_slot": "i32"}
    consts = {"BLOCK_N": 64, "PTX": cuda, "FLAGS": True, "EARLY": True, "SLEEP": 200 * cuda,
              "DEP": dep, "PDL": cuda}
    spec = aot.KernelSpec("flow", chain_bench._flow_kernel,
                          {**sig, **{k: "constexpr" for k in consts}}, consts, 2, False,
                          divisible=("q_ptr", "dx_ptr", "bs_ptr", "w_ptr", "y_ptr"),
                          backend=target.partition(":")[0])
    kernel = aot.build(spec, target)
    info = aot.check_asm(spec, target, kernel)
    assert not info["problems"], info
    if cuda:
        ptx = kernel.asm["ptx"]
        assert "ld.global.gpu.acquire" in ptx and "atom.global.gpu.release.add" in ptx
        assert "griddepcontrol.wait" not in ptx and "griddepcontrol.launch_dependents" in ptx
        assert "nanosleep" in ptx


@pytest.mark.parametrize("target,groups", [("cuda:90", 0), ("hip:gfx1151", 0),
                                           ("cuda:90", 16)])
def test_barrier_variant_builds(target, groups):
    sys.path[:0] = [str(BENCH)]
    try:
        import chain_bench
    finally:
        sys.path.remove(str(BENCH))
    from kernels import aot

    sig = {"q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*i32", "w_ptr": "*u8",
           "y_ptr": "*fp32", "ctr_ptr": "*i32", "N": "i32", "K": "i32", "row_bytes": "i32",
           "layer_bytes": "i64", "sb_per_split": "i32", "layers": "i32", "dx_slot": "i32"}
    consts = {"BLOCK_N": 64, "S": 8, "PTX": target.startswith("cuda"), "BARRIER": True,
              "PREFETCH": True, "DEP": False, "GROUPS": groups}
    spec = aot.KernelSpec("chain", chain_bench._chain_kernel,
                          {**sig, **{k: "constexpr" for k in consts}}, consts, 2, False,
                          divisible=("q_ptr", "dx_ptr", "bs_ptr", "w_ptr", "y_ptr"),
                          max_regs=128 if target.startswith("cuda") else None)
    kernel = aot.build(spec, target)
    info = aot.check_asm(spec, target, kernel)
    assert not info["problems"], info
    if target.startswith("cuda"):
        ptx = kernel.asm["ptx"]
        assert "atom.global.gpu.release.add" in ptx and "ld.global.gpu.acquire" in ptx
        # the tree's group count: acquire (the members' stores) and release at once
        assert ("atom.global.gpu.acq_rel.add" in ptx) == (groups > 0)
