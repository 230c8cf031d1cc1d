"""kernels/qint_mma.py: the Gluon mma.sync Q4_K kernel builds for sm_90 on the CPU (its
products on the matrix unit, nothing spilled), and on the GPU gives qint's bits and the
definition's sums (gguf-py's dequantized weights in float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_qint import check, rng  # noqa: F401 - the fixture
from test_qmatmul import random_weight

from kernels import qint_mma
from kernels.triton_util import HAS_TRITON

SIGNATURE = {"q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*fp16", "w_ptr": "*u8",
             "y_ptr": "*fp32", "part_ptr": "*fp32", "ticket_ptr": "*i32", "M": "i32",
             "N": "i32", "K": "i32", "row_bytes": "i32", "sb_per_split": "i32",
             "nsplit": "i32", "ticket": "i32", "tiles": "i32"}
ALIGNED = ("q_ptr", "dx_ptr", "bs_ptr", "w_ptr", "y_ptr", "part_ptr", "ticket_ptr", "K",
           "row_bytes")


def build(**consts):
    """The kernel compiled for cuda:90 (no device needed) at these constexprs."""
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels import aot
    from kernels.triton_util import triton

    consts = {"RPW": 16, "KW": 8, "UNROLL": 2, "XSMEM": True, "PERSIST": False, **consts}
    sig = {**SIGNATURE, **{k: "constexpr" for k in consts}}
    names = list(sig)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in ALIGNED}
    src = GluonASTSource(qint_mma._qint_mma_q4k_kernel, sig, consts, attrs)
    kernel = triton.compile(src, target=aot._target("cuda:90"),
                            options={"num_warps": consts["WARPS"]})
    return kernel, aot._cubin_resources(kernel.asm["cubin"])


@pytest.mark.parametrize("consts", [{"WARPS": 4}, {"WARPS": 4, "XSMEM": False, "UNROLL": 1},
                                    {"WARPS": 4, "RPW": 32}, {"WARPS": 8},
                                    {"WARPS": 4, "PERSIST": True}],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_builds_for_sm90_on_the_matrix_unit(consts):
    """Every super-block: 8 sub-blocks x 2 halves of x's rows as s8 m16n8k32 products (a
    warp's RPW rows: RPW / 16 times that), the mins as f16 m16n8k16 products; no spills."""
    assert HAS_TRITON and qint_mma.HAS_GLUON, "CI installs Triton 3.6, which has Gluon"
    kernel, res = build(**consts)
    ptx = kernel.asm["ptx"]
    per_sb = (1 + (consts.get("UNROLL", 2) == 2)) * consts.get("RPW", 16) // 16
    assert ptx.count("mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32") == 16 * per_sb
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == 2 * per_sb
    if res:  # Triton's cuobjdump was found
        assert res["stack_bytes"] == 0 and res["regs"] <= 168, res


@pytest.mark.gpu
def test_gpu_same_bits_as_qint(rng):  # noqa: F811 - the fixture
    """On the GPU, every variant at rows that leave x's tile partly filled and N that
    leaves the last program partly filled, each split the shape allows: qint_triton's bits
    at its own split, and within 2^-16 of the definition at every split."""
    if not torch.cuda.is_available():
        pytest.fail("no GPU: run the gpu tests on the device")
    from kernels import qint
    from kernels.qgemv import _tickets

    for n, k in ((1000, 2048), (320, 14336)):
        blocks = random_weight(T.Q4_K, n, k, rng)
        x = torch.from_numpy(rng.standard_normal((16, k), dtype=np.float32))
        held = blocks.cuda()
        for m in (9, 13, 16):
            xq = qint.quantize_x(x[:m].cuda())
            split = qint.default_qint_config(qint.Q4_K, n, k, qint._num_sms(held.device), m=m).split
            want = qint.qint_triton(x[:m].cuda(), held, qint.Q4_K, (n, k), xq=xq).cpu()
            for warps, rpw, unroll, xsmem in ((4, 16, 2, True), (4, 16, 1, False),
                                              (4, 32, 2, True), (8, 16, 2, True)):
                for s in sorted({1, 2, split, k // 256}):
                    if (k // 256) % s:
                        continue
                    for tickets in (_tickets(held.device), None):
                        y = qint_mma.qint_mma_launch(xq, held, n, k, s, warps=warps,
                                                     rows_per_warp=rpw, unroll=unroll,
                                                     xsmem=xsmem, tickets=tickets).cpu()
                        check(y, x[:m], blocks, T.Q4_K)
                        if s == split:
                            assert torch.equal(y, want), (n, k, m, warps, rpw, unroll, s)
