"""bench/gpu/rows_ring_bench.py on the CPU: its ring kernel built for sm_90 as the bench
runs it (every config): every weight copy 16 bytes (cp.async.cg), the codes read back 16
bytes a thread, the scale bytes picked by prmt, and the PDL build's wait after its first
copies; the gap kernel spins on the global timer and waits for the kernel before it."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="the CPU torch build has no Triton")


@pytest.fixture(scope="module")
def rows_ring_bench():
    sys.path[:0] = [str(BENCH)]
    try:
        import rows_ring_bench as module
    finally:
        sys.path.remove(str(BENCH))
    return module


def _ptx(src, warps: int) -> str:
    from triton.backends.compiler import GPUTarget

    from kernels.triton_util import triton

    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps}).asm["ptx"]


def test_ring_builds_as_measured(rows_ring_bench):
    if not rows_ring_bench.HAS_GLUON:
        pytest.fail("Triton without Gluon: the ring kernel cannot be built")
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.triton_util import compiled

    sig = {"w_ptr": "*u8", "q_ptr": "*i8", "bs_ptr": "*i32", "dx_ptr": "*fp32",
           "y_ptr": "*fp32", "ctr_ptr": "*i32", "N": "i32", "K": "i32", "layers": "i32",
           "W": "constexpr", "RPT": "constexpr", "S": "constexpr", "D": "constexpr",
           "WAIT": "constexpr", "PDL": "constexpr"}
    names = list(sig)
    aligned = ("w_ptr", "q_ptr", "bs_ptr", "dx_ptr", "y_ptr", "ctr_ptr", "K")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    for config in rows_ring_bench.CONFIGS.split(","):
        warps, rpt, s, d, _ = (int(v) for v in config.split(":"))
        consts = {"W": warps, "RPT": rpt, "S": s, "D": d, "WAIT": True, "PDL": True}
        ptx = _ptx(GluonASTSource(compiled(rows_ring_bench._rows_kernel), sig, consts, attrs),
                   warps)
        sizes = set(re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)",
                               ptx))
        assert sizes == {"0x10"}, (config, sizes)
        assert re.search(r"ld\.shared\.v4\.b32", ptx), config  # a thread's quad at once
        assert ptx.count("prmt.b32") >= 3 * s * rpt, config  # two scales and a min a row
        first_wait = ptx.index("griddepcontrol.wait")
        assert ptx.index("cp.async") < first_wait, config  # the first slots before the wait


def test_gap_kernel_spins_after_its_wait(rows_ring_bench):
    from triton.compiler import ASTSource

    from kernels.triton_util import compiled

    sig = {"out_ptr": "*i32", "ns": "i32", "PDL": "constexpr"}
    ptx = _ptx(ASTSource(compiled(rows_ring_bench._gap_kernel), sig, {"PDL": True}), 1)
    assert "%globaltimer" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("griddepcontrol.launch_dependents") \
        < ptx.index("%globaltimer")  # a `t` gap: the next launch starts before the spin
    plain = _ptx(ASTSource(compiled(rows_ring_bench._gap_kernel), sig, {"PDL": False}), 1)
    assert "griddepcontrol" not in plain


def test_close_takes_the_worst_product(rows_ring_bench):
    import torch

    want = torch.tensor([[1.0, -2.0], [4.0, 8.0]])
    assert rows_ring_bench.close(want.clone(), want) == (True, 0.0)
    off = want.clone()
    off[1, 1] += 8.0 * 2e-5  # 2e-5 of the second product's largest
    ok, err = rows_ring_bench.close(off, want)
    assert not ok and err == pytest.approx(2e-5, rel=1e-2)  # float32 8 + 1.6e-4


def test_gap_specs(rows_ring_bench):
    assert rows_ring_bench.gap_spec("0") == (0.0, False)
    assert rows_ring_bench.gap_spec("2.5") == (2.5, False)
    assert rows_ring_bench.gap_spec("3t") == (3.0, True)
    with pytest.raises(ValueError):
        rows_ring_bench.gap_spec("t")
