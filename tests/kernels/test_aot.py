"""Every kernel builds ahead of time for hip:gfx1151 (to the hsaco) and cuda:90 (to the
cubin), and its dots lower to the tensor-core instructions of each chip (WMMA on RDNA 3.5,
mma/wgmma on Hopper). The build runs in a background process (background.py)."""

from __future__ import annotations

import inspect
import re

import background
import pytest

from kernels import paged_attention_triton, qgemv, qint, qint_mm, qint_mma, qmatmul
from kernels.triton_util import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the CPU torch build has no Triton")
TARGETS = ("hip:gfx1151", "cuda:90")


@pytest.fixture(scope="module")
def report() -> dict:
    run = background.result("aot")
    report = background.last_json(run.stdout)
    assert report is not None, run.stderr[-4000:]
    return report


def test_every_kernel_builds_for_both_targets(report):
    """Every spec builds for its targets: both, or its backend's (a config of one backend,
    such as a tile candidate of the load-time tuner, names one build)."""
    from kernels.aot import kernel_specs

    assert report, "no kernel compiled"
    want: dict[str, set[str]] = {}
    for spec in kernel_specs(quick=True):
        want.setdefault(spec.name, set()).update(
            t for t in TARGETS if spec.backend is None or t.startswith(spec.backend))
    assert set(report) == set(want)
    assert sum(len(t) == len(TARGETS) for t in want.values()) > len(want) // 2
    for name, targets in report.items():
        assert set(targets) == want[name], name
        for target, info in targets.items():
            assert not info["problems"], (name, target, info.get("error"), info["problems"])
            binary = "hsaco" if target.startswith("hip") else "cubin"
            assert binary in info["stages"] and info["binary_bytes"] > 0, (name, target)


def test_dots_lower_to_tensor_cores(report):
    """bf16 dots (qmatmul) and f16 dots (attention) use the matching WMMA / MMA ops;
    qint's tiled kernels the int8 ones (Q4_K also one f16 dot for its mins' sums, the
    Gluon Q6_K one for its scales times x's sums); qint's CUDA-core kernels none."""
    int8 = {"hip:gfx1151": "v_wmma_i32_16x16x16_iu8", "cuda:90": ".s32.s8.s8"}
    for name, targets in report.items():
        if "merge" in name or "sum_splits" in name or "_fma_" in name or (
                name.startswith("moe_") and not name.startswith("moe_matmul")):  # no dots
            continue
        if name.startswith("qint_") and not name.endswith("_tiled"):
            assert targets["hip:gfx1151"]["wmma"] == 0 and targets["cuda:90"]["mma"] == 0, name
            continue
        if name.startswith("qint_"):
            for target, info in targets.items():
                assert any(int8[target] in op for op in info["ops"]), (name, target, info)
                f16 = {op for op in info["ops"] if int8[target] not in op}
                assert f16 <= {op for op in info["ops"] if op.endswith("_f16")
                               or ".f16.f16" in op}, (name, target, info)
                assert bool(f16) == ("Q4_K" in name or name.startswith("qint_mma_")), (
                    name, target, info)
            continue
        dtype = "bf16" if name.startswith(("qmatmul", "moe_matmul")) else "f16"
        hip, cuda = targets["hip:gfx1151"], targets["cuda:90"]
        assert hip["wmma"] > 0 and all(op.endswith(f"_{dtype}") for op in hip["ops"]), hip
        assert cuda["mma"] > 0 and all(f".{dtype}." in op for op in cuda["ops"]), cuda


def test_qint_builds_spill_nothing(report):
    """qint's kernels at their default configurations keep every value in registers on
    both targets (a spill goes through local memory on every super-block), and the 16-row
    tile's sm_90 build stays within its register cap (qint_mm.TILED_MAX_REGS: 4 programs a
    multiprocessor instead of 3), as does Q4_K's one-row build (qint.Q4K_ONE_ROW_REGS).
    The load-time tuner's other candidates must build (the tests above) and may spill:
    32 x 128 and 64 x 128 on 4 warps do, and are timed."""
    names = [name for name in report if name.startswith("qint_") and "_cand_" not in name]
    assert any("_cand_" in name for name in report)
    assert "qint_Q4_K_tiled" in names and "qint_Q6_K_tiled" in names, names
    for name in names:
        hip, cuda = report[name].get("hip:gfx1151"), report[name]["cuda:90"]
        assert hip is not None or name.startswith("qint_mma_"), name  # NVIDIA's alone
        assert hip is None or hip["vgpr_spills"] == 0, (name, hip)
        assert "regs" in cuda, (name, "cuobjdump gave no resource usage", cuda)
        # the Gluon two-type kernel keeps 8 bytes outside its loops (qint_mma.FUSED_MAX_REGS)
        assert cuda["stack_bytes"] <= (8 if name.startswith("qint_mma_Q4_K_Q6_K") else 0), (
            name, cuda)
        if name.endswith("_tiled") and not re.search(r"^qint_mma_.*_m\d+_pdl_tiled$", name):
            # (the Gluon kernel's 32- and 64-row builds: test_qint_mma's own bounds)
            assert cuda["regs"] <= qint_mm.TILED_MAX_REGS, (name, cuda)
        if name.startswith("qint_Q4_K_m1"):  # alone at one row: 9 programs of 2 warps
            assert cuda["regs"] <= qint.Q4K_ONE_ROW_REGS, (name, cuda)


def test_moe_products_spill_nothing_on_the_appliances_chip(report):
    """Every grouped MoE product (each type, skinny and tiled, gated) keeps its values in
    registers on gfx1151 at the configs moe.MoEPlan launches there (a spill goes through
    scratch memory on every K step; MXFP4's, gpt-oss's experts, spilled 76-88 VGPRs)."""
    names = [name for name in report if name.startswith("moe_matmul_")]
    assert {"moe_matmul_MXFP4", "moe_matmul_MXFP4_gated", "moe_matmul_Q6_K_gated",
            "moe_matmul_Q4_K_m64"} <= set(names), names
    for name in names:
        assert report[name]["hip:gfx1151"]["vgpr_spills"] == 0, (name, report[name])


def test_pdl_builds_wait_for_their_inputs(report):
    """The sm_90 builds made as programmatic dependent launches (PDL set) wait for the
    previous kernel (griddepcontrol.wait); the others do not; no gfx1151 build sets it."""
    from kernels.aot import kernel_specs

    specs = kernel_specs(quick=True)
    assert any(s.constexprs.get("PDL") for s in specs)
    for spec in specs:
        pdl = bool(spec.constexprs.get("PDL"))
        assert not (pdl and spec.backend != "cuda"), spec.name
        if spec.backend in (None, "cuda"):
            assert (report[spec.name]["cuda:90"]["gdc_waits"] > 0) == pdl, spec.name


def test_skinny_and_tiled_qmatmul_use_the_same_instruction(report):
    """Batch invariance needs a row's dot products to run through the same matrix
    instruction whether M takes the skinny kernel (kernels/qgemv.py, 16 columns of x) or
    the tiled one (64): the same op up to its N width (wgmma m64nNk16 on sm_90). Q4_K
    multiplies the weight tile by x, Q6_K x by the weight tile (qgemv.X_LEFT_TYPES), with
    mma.sync m16n8k16 on sm_90 for both paths (qgemv.MMA_SYNC_TYPES)."""
    for qtype in ("Q4_K", "Q6_K"):
        for target in TARGETS:
            skinny = report[f"qmatmul_{qtype}_m16"][target]["ops"]
            tiled = report[f"qmatmul_{qtype}_m64"][target]["ops"]
            family = {re.sub(r"n\d+k", "nNk", op) for op in skinny}
            assert skinny and family == {re.sub(r"n\d+k", "nNk", op) for op in tiled}, (
                qtype, target, skinny, tiled)


def test_every_kernel_has_a_spec():
    """A new @triton.jit (or Gluon) kernel in these modules must be added to the AOT
    specs."""
    from triton.runtime.jit import JITFunction

    from kernels.aot import KernelSpec

    for module in (qgemv, qint, qint_mma, qmatmul, paged_attention_triton):
        kernels = {name for name, obj in inspect.getmembers(module)
                   if isinstance(obj, JITFunction) and name.endswith("_kernel")}
        specced = {spec.kernel.__name__ for spec in module.aot_specs(KernelSpec)}
        assert kernels and kernels <= specced, (module.__name__, kernels - specced)
