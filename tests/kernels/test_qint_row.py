"""kernels/qint_row.py: the one-row Q4_K kernel with a weight row a thread builds for sm_90
on the CPU (its weights by 16-byte cp.async, a row's words read from shared memory, no
shuffle in its loop, nothing spilled), qint takes it where it should, and on the GPU it
gives qint's Triton kernel's bits and the definition's sums (gguf-py's dequantized weights
in float64)."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_qint import check, rng  # noqa: F401 - the fixture
from test_qmatmul import random_weight

from kernels import qint_row
from kernels.triton_util import HAS_TRITON


def build(splits: int):
    """The aot spec of `splits` compiled for cuda:90 (no device needed): kernel, its
    registers and stack, and its longest loop's instruction counts by opcode."""
    from kernels import aot

    spec = next(s for s in qint_row.aot_specs(aot.KernelSpec) if s.name == f"qint_row_s{splits}")
    kernel = aot.build(spec, "cuda:90")
    sass = aot.cuobjdump(kernel.asm["cubin"], "-sass")
    code = [(int(m.group(1), 16), m.group(2), line) for line in sass.splitlines()
            if (m := re.match(r"\s+/\*([0-9a-f]{4})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", line))]
    loops = [(int(t.group(1), 16), at) for at, op, line in code
             if op == "BRA" and (t := re.search(r"BRA (0x[0-9a-f]+)", line))
             and int(t.group(1), 16) < at]
    first, last = max(loops, key=lambda span: span[1] - span[0])
    ops = collections.Counter(op for at, op, _ in code if first <= at <= last)
    return kernel, aot._cubin_resources(kernel.asm["cubin"]), ops


@pytest.mark.parametrize("splits", [8, 2])
def test_builds_for_sm90_a_row_a_thread(splits):
    """A super-block a thread: its row's codes and head by nine 16-byte cp.async (issued
    before the programmatic dependent wait too) and nine 16-byte shared reads, 64 dp4a
    (two chains of 8 a group of 8 words), the 16 scales and mins by PRMT, x by 16-byte
    broadcasts; no shuffle and one barrier in the loop; at most 140 registers and nothing
    spilled; 72 KB of shared memory at 8 splits (2 stages), 27 KB at 2 (3 stages)."""
    assert HAS_TRITON and qint_row.HAS_GLUON, "CI installs Triton 3.6, which has Gluon"
    kernel, res, ops = build(splits)
    assert ops["LDGSTS.E.BYPASS.128"] == 9, ops
    assert ops["LDS.128"] == 9, ops
    assert ops["IDP.4A.S8.S8"] + ops["IDP.4A.U8.S8"] == 64, ops
    assert ops["PRMT"] == 16, ops
    assert ops["LDG.E.128"] == 20, ops  # x's 64 words and 16 sums
    assert not any(op.startswith("SHFL") for op in ops), ops
    assert ops["BAR.SYNC.DEFER_BLOCKING"] <= 2, ops
    assert sum(ops.values()) < 340, ops  # qint's Triton loop: 385 (a row's super-block)
    assert res["regs"] <= 140 and res["stack_bytes"] == 0, res
    assert kernel.metadata.shared == {8: 72, 2: 27}[splits] * 1024
    ptx = kernel.asm["ptx"]
    assert ptx.index("cp.async") < ptx.index("griddepcontrol.wait")


def test_stages_and_launch_checks():
    assert qint_row.stages_of(8) == qint_row.STAGES and qint_row.stages_of(2) == 3
    for split in (3, 0, 32):  # not a power of 2, none, more than the 16 super-blocks
        with pytest.raises(ValueError, match="splits"):
            qint_row.qint_row_launch(None, None, 64, 4096, split)


def test_row_path_only_where_it_applies(monkeypatch):
    monkeypatch.delenv("MBUFO_QINT_ROW", raising=False)
    on = qint_row.HAS_GLUON
    assert qint_row.row_path(1, 4096, "cuda", torch.int32) is on
    assert not qint_row.row_path(2, 4096, "cuda", torch.int32)  # one row of x only
    assert not qint_row.row_path(1, 4096, "hip", torch.int32)
    assert not qint_row.row_path(1, 4096, "cpu", torch.int32)
    assert not qint_row.row_path(1, 4096, "cuda", torch.float16)  # sums as qint holds them
    monkeypatch.setenv("MBUFO_QINT_ROW", "0")
    assert not qint_row.row_path(1, 4096, "cuda", torch.int32)


@pytest.mark.gpu
def test_gpu_same_bits_as_qint(rng, monkeypatch):  # noqa: F811 - the fixture
    """On the GPU, at Llama-3.1-8B's one-row Q4_K shapes and at N that leaves the last
    program partly filled: the engine's launch (qint_triton, which takes this kernel at
    one row) gives the bits of qint's Triton kernel (MBUFO_QINT_ROW=0) at the same split,
    and is within 2^-16 of the definition."""
    if not torch.cuda.is_available():
        pytest.fail("no GPU: run the gpu tests on the device")
    from kernels import qint

    for n, k in ((4096, 4096), (75, 4096), (4096, 14336), (1000, 2048), (28672, 4096)):
        blocks = random_weight(T.Q4_K, n, k, rng)
        held = blocks.cuda()
        x = torch.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
        xq = qint.quantize_x(x.cuda())
        cfg = qint.default_qint_config(qint.Q4_K, n, k, torch.cuda.get_device_properties(
            0).multi_processor_count, m=1)
        assert cfg.in_cta and qint_row.row_path(1, k, "cuda", xq.bs.dtype), cfg
        got = qint.qint_triton(x.cuda(), held, qint.Q4_K, (n, k), xq=xq).cpu()
        monkeypatch.setenv("MBUFO_QINT_ROW", "0")
        want = qint.qint_triton(x.cuda(), held, qint.Q4_K, (n, k), xq=xq).cpu()
        monkeypatch.delenv("MBUFO_QINT_ROW")
        assert torch.equal(got, want), (n, k, cfg)
        check(got, x, blocks, T.Q4_K)
        for split in (1, 2, 4, 8):  # every split the kernel builds, against qint's
            one = qint.in_cta_config(qint.QIntConfig(8 * split, split, 2)) if split > 1 \
                else qint.QIntConfig(32, 1, 2)
            if (k // 256) % split or not one.in_cta:
                continue
            got = qint.qint_triton(x.cuda(), held, qint.Q4_K, (n, k), one, xq=xq).cpu()
            monkeypatch.setenv("MBUFO_QINT_ROW", "0")
            want = qint.qint_triton(x.cuda(), held, qint.Q4_K, (n, k), one, xq=xq).cpu()
            monkeypatch.delenv("MBUFO_QINT_ROW")
            assert torch.equal(got, want), (n, k, split)
