"""bench/gpu/qint_gemv_async.py (an experiment, not called by the engine): its one-row
Gluon kernel builds for sm_90 on the CPU as the bench launches it, its dot products on
dp4a and its weights by cp.async, nothing spilled; the launch refuses what it cannot
multiply. Its bits against qint's kernel and its times come from the bench on the GPU."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from kernels import qint_mma

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import qint_gemv_async  # noqa: E402


def test_builds_for_sm90_on_dp4a_from_shared_memory():
    """64 rows on 2 warps, 4 stages (the bench's first variant): a super-block is 64
    dp4a a thread (32 code words, their low and high nibbles), the codes copied 16 bytes
    at a time; no spill, and 96 registers and 38 KB leave 5 programs a multiprocessor."""
    assert qint_mma.HAS_GLUON, "CI installs Triton 3.6, which has Gluon"
    from kernels import aot

    sig = {"q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*i32", "w_ptr": "*u8",
           "y_ptr": "*fp32", "part_ptr": "*fp32", "ticket_ptr": "*i32", "M": "i32", "N": "i32",
           "K": "i32", "row_bytes": "i32", "sb_per_split": "i32", "nsplit": "i32",
           "ticket": "i32", "BN": "constexpr", "WARPS": "constexpr", "STAGES": "constexpr",
           "PDL": "constexpr"}
    consts = {"BN": 64, "WARPS": 2, "STAGES": 4, "PDL": True}
    divisible = ("q_ptr", "dx_ptr", "bs_ptr", "w_ptr", "y_ptr", "part_ptr", "ticket_ptr", "K",
                 "row_bytes")
    spec = aot.KernelSpec("qint_gemv_async", qint_gemv_async._gemv1_q4k_kernel, sig, consts,
                          2, False, "cuda", None, divisible)
    kernel = aot.build(spec, "cuda:90")
    ptx = kernel.asm["ptx"]
    assert ptx.count("dp4a.s32.s32") == 64
    # a thread's 16-byte copies of the codes: 8 at each of the 3 prologue issues and the
    # loop's
    assert len(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], 0x10\b",
                          ptx)) == 8 * 4
    assert "griddepcontrol.wait" in ptx
    res = aot._cubin_resources(kernel.asm["cubin"])
    if res:  # Triton's cuobjdump was found
        assert res["stack_bytes"] == 0 and res["regs"] <= 96, res
    assert kernel.metadata.shared <= 38 * 1024


def test_launch_takes_one_row_with_int32_sums():
    from kernels import qint

    for m in (2, 3):
        xq = qint.QuantX(*qint.empty_quant_x(m, 256, torch.device("cpu")))
        with pytest.raises(ValueError, match="one row"):
            qint_gemv_async.gemv1_launch(xq, torch.zeros(64, 144, dtype=torch.uint8), 64,
                                         256, 1)
