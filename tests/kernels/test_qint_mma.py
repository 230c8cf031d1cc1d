"""kernels/qint_mma.py: the Gluon mma.sync Q4_K kernel builds for sm_90 on the CPU (its
products on the matrix unit, its operands by cp.async, nothing spilled), qint takes it
where it should, and on the GPU it gives qint's bits and the definition's sums (gguf-py's
dequantized weights in float64)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_qint import check, rng  # noqa: F401 - the fixture
from test_qmatmul import random_weight

from kernels import qint_mm, qint_mma, quant_x
from kernels.triton_util import HAS_TRITON, num_sms


def build(qtype: str = "Q4_K", **consts):
    """The kernel of `qtype` (Q4_K or Q6_K) compiled for cuda:90 (no device needed) as
    kernels/aot.py builds it, at these constexprs."""
    from kernels import aot

    spec = next(s for s in qint_mma.aot_specs(aot.KernelSpec)
                if s.name == f"qint_mma_{qtype}_tiled")
    consts = {**spec.constexprs, **consts}
    kernel = aot.build(spec._replace(constexprs=consts, num_warps=consts["WARPS"]), "cuda:90")
    return kernel, aot._cubin_resources(kernel.asm["cubin"])


# a super-block's products (s8 m16n8k32, f16 m16n8k16) and a thread's copies at one issue
# on 4 warps (16 bytes: the codes, or Q6_K's ql and qh, and x's codes: Q6_K's twice; 8:
# Q6_K's scales; 4: Q4_K's head words, x's sums and scales), its registers and shared
# memory at the defaults: Q4_K 6 programs a multiprocessor, Q6_K 5
SHAPE = {"Q4_K": (16, 2, {"0x4": 6, "0x8": 0, "0x10": 6}, 80, 32 * 1024),
         "Q6_K": (32, 2, {"0x4": 2, "0x8": 1, "0x10": 10}, 96, 44 * 1024),
         "Q4_K_Q6_K": (48, 4, {"0x4": 8, "0x8": 1, "0x10": 16}, qint_mma.FUSED_MAX_REGS,
                       44 * 1024)}


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_K_Q6_K"])
@pytest.mark.parametrize("consts", [{}, {"PDL": True}, {"STAGES": 3}, {"WARPS": 8}],
                         ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()) or "default")
def test_builds_for_sm90_on_the_matrix_unit(qtype, consts):
    """A super-block: Q4_K's 8 sub-blocks x 2 halves of x's rows as s8 m16n8k32 products
    and its mins as 2 f16 m16n8k16 ones; Q6_K's 8 runs of 32 columns x 2 sub-blocks x 2
    halves, its scales times x's 16-column sums as 2 f16 ones; the operands by cp.async;
    the PDL build waits for the previous kernel; nothing spilled, and the defaults leave
    Q4_K 6 programs a multiprocessor and Q6_K 5 (registers and shared memory); the
    two-type kernel (q|k in Q4_K, v in Q6_K) has both paths in Q6_K's shared memory and,
    under its register cap, 5 programs too, spilling 8 bytes (outside its loops: see
    FUSED_MAX_REGS)."""
    assert HAS_TRITON and qint_mma.HAS_GLUON, "CI installs Triton 3.6, which has Gluon"
    kernel, res = build(qtype, **consts)
    ptx = kernel.asm["ptx"]
    s8, f16, copied, regs, shared = SHAPE[qtype]
    assert ptx.count("mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32") == s8
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == f16
    copies = {w: len(re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], "
                                + w + r"\b", ptx)) for w in ("0x4", "0x8", "0x10")}
    if consts.get("WARPS", 4) == 4:  # at the prologue's STAGES - 1 issues and the loop's
        sites = consts.get("STAGES", qint_mma.STAGES)
        assert copies == {w: c * sites for w, c in copied.items()}, copies
    assert ("griddepcontrol.wait" in ptx) == consts.get("PDL", False)
    if res:  # Triton's cuobjdump was found
        # the two-type kernel's cap spills 8 bytes at the defaults, 16 at 3 stages
        spill = 0 if qtype != "Q4_K_Q6_K" else 8 if consts.get("STAGES", 2) == 2 else 16
        assert res["stack_bytes"] <= spill, res
    if not consts:
        assert res.get("regs", 0) <= regs and kernel.metadata.shared <= shared, (
            res, kernel.metadata.shared)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q4_K_Q6_K"])
@pytest.mark.parametrize("rows", [32, 64])
def test_wider_builds_multiply_every_row_without_spilling(qtype, rows):
    """The 32- and 64-row builds (as the engine launches them: PDL) take rows / 16 times
    the 16-row build's products a super-block, copy x's rows in full, spill nothing (the
    two-type kernel uncapped, Q4_K's 64-row one under WIDE_Q4K_MAX_REGS) and leave at least
    two programs a multiprocessor (registers and shared memory), Q4_K's 64-row one three."""
    from kernels import aot

    spec = next(s for s in qint_mma.aot_specs(aot.KernelSpec)
                if s.name == f"qint_mma_{qtype}_m{rows}_pdl_tiled")
    assert spec.constexprs["BM"] == rows
    assert spec.max_regs == (qint_mma.WIDE_Q4K_MAX_REGS if (qtype, rows) == ("Q4_K", 64)
                             else None)
    kernel = aot.build(spec, "cuda:90")
    res = aot._cubin_resources(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    s8, f16 = SHAPE[qtype][:2]
    assert ptx.count("mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32") == \
        s8 * rows // 16
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") == f16 * rows // 16
    assert "griddepcontrol.wait" in ptx
    if res:
        assert res["stack_bytes"] == 0, res
        assert 2 * 128 * res["regs"] <= 65536, res
    assert 2 * kernel.metadata.shared <= 228 * 1024
    if (qtype, rows) == ("Q4_K", 64):  # capped: three programs a multiprocessor
        assert not res or res["regs"] <= qint_mma.WIDE_Q4K_MAX_REGS, res
        assert 3 * kernel.metadata.shared <= 228 * 1024


def test_register_caps_by_build_and_switch(monkeypatch):
    """Q4_K's 64-row build alone is capped (MBUFO_QINT_MMA_CAP=0: uncapped), the two-type
    kernel only at 16 rows, Q6_K never."""
    monkeypatch.delenv("MBUFO_QINT_MMA_CAP", raising=False)
    caps = {(rows, q6, fused): qint_mma.max_regs_of(rows, q6, fused)
            for rows in qint_mma.TILE_ROWS for q6 in (False, True) for fused in (False, True)}
    assert caps.pop((64, False, False)) == qint_mma.WIDE_Q4K_MAX_REGS
    assert caps.pop((16, False, True)) == caps.pop((16, True, True)) == qint_mma.FUSED_MAX_REGS
    assert set(caps.values()) == {None}
    monkeypatch.setenv("MBUFO_QINT_MMA_CAP", "0")
    assert qint_mma.max_regs_of(64, False, False) is None


def test_tile_rows_holds_m():
    assert [qint_mma.tile_rows(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    with pytest.raises(ValueError, match="at most 64 rows"):
        qint_mma.tile_rows(65)


def test_engine_takes_it_for_q4k_and_q6k_up_to_64_rows_on_nvidia(monkeypatch):
    """qint's matrix-unit launches of Q4_K or Q6_K_A alone at up to 64 rows on NVIDIA take
    it, and so do Q4_K's q|k with Q6_K_A's v in one launch; more rows (or more than
    MBUFO_QINT_MMA_ROWS), another type or pair, HIP, the CPU, a forced tile (the tuner) or
    MBUFO_QINT_MMA=0 keep _qint_mm_kernel."""
    from kernels.qint import Q6_K_A, mma_path
    from kernels.qint_mm import forced_tile

    cuda, q4 = torch.device("cuda"), int(T.Q4_K)
    assert mma_path(16, q4, 0, "cuda", cuda) and mma_path(5, q4, 0, "cuda", cuda)
    assert mma_path(16, Q6_K_A, 0, "cuda", cuda) and mma_path(9, Q6_K_A, 0, "cuda", cuda)
    assert mma_path(64, q4, 0, "cuda", cuda) and mma_path(33, Q6_K_A, 0, "cuda", cuda)
    assert mma_path(64, q4, Q6_K_A, "cuda", cuda)
    assert not mma_path(65, q4, 0, "cuda", cuda)
    assert not mma_path(65, Q6_K_A, 0, "cuda", cuda)
    monkeypatch.setenv("MBUFO_QINT_MMA_ROWS", "16")
    assert mma_path(16, q4, 0, "cuda", cuda) and not mma_path(17, q4, 0, "cuda", cuda)
    monkeypatch.setenv("MBUFO_QINT_MMA_ROWS", "many")
    with pytest.raises(ValueError, match="MBUFO_QINT_MMA_ROWS"):
        mma_path(16, q4, 0, "cuda", cuda)
    monkeypatch.delenv("MBUFO_QINT_MMA_ROWS")
    assert not mma_path(16, int(T.Q6_K), 0, "cuda", cuda)  # GGUF's rows: held as Q6_K_A
    assert mma_path(16, q4, Q6_K_A, "cuda", cuda)  # q|k and v in one launch
    assert not mma_path(16, Q6_K_A, q4, "cuda", cuda)
    assert not mma_path(16, q4, q4, "cuda", cuda)
    assert not mma_path(16, q4, 0, "hip", cuda)
    assert not mma_path(16, q4, 0, "cuda", torch.device("cpu"))
    with forced_tile((16, 64, 4)):
        assert not mma_path(16, q4, 0, "cuda", cuda)
    monkeypatch.setenv("MBUFO_QINT_MMA", "0")
    assert not mma_path(16, q4, 0, "cuda", cuda)


def test_cuda_cores_keep_fewer_rows_where_the_gluon_kernel_takes_the_rest(monkeypatch,
                                                                          rng):  # noqa: F811
    """The CUDA cores' row bounds: Q4_K 4 and Q6_K_A 8 where qint's Triton kernel takes
    the matrix unit's launches (HIP, MBUFO_QINT_MMA=0, a forced tile, no device given), 2
    and 4 where the Gluon kernel does (its time flat over 1-16 rows). At 3 rows Q4_K and a
    q|k + v pair go to it (one launch), Q6_K_A alone stays on the CUDA cores; at 6 rows
    all three go to it."""
    from kernels import qint

    cuda = torch.device("cuda")
    assert qint.gemv_max_m(qint.Q4_K, "cuda", cuda) == 2
    assert qint.gemv_max_m(qint.Q6_K_A, "cuda", cuda) == 4
    assert qint.gemv_max_m(qint.Q4_K, "hip", cuda) == qint.GEMV_MAX_M == 4
    assert qint.gemv_max_m(qint.Q6_K_A, "hip", cuda) == 8
    assert qint.gemv_max_m(qint.Q6_K_A) == 8
    with qint_mm.forced_tile((16, 64, 4)):
        assert qint.gemv_max_m(qint.Q6_K_A, "cuda", cuda) == 8
    monkeypatch.setenv("MBUFO_QINT_MMA", "0")
    assert qint.gemv_max_m(qint.Q4_K, "cuda", cuda) == 4
    monkeypatch.delenv("MBUFO_QINT_MMA")
    calls = []

    def fake(xq, blocks, n, k, split, tickets=None, *, q6=False, second=None, **kw):
        calls.append((xq.q.shape[0], "mma", q6, second is not None))
        return torch.zeros(xq.q.shape[0], n)

    class Grid:  # a launch of qint's Triton kernels, recorded
        def __init__(self, kernel, device):
            self.name = kernel.__name__ if hasattr(kernel, "__name__") else kernel.fn.__name__

        def __getitem__(self, grid):
            return lambda *args, **kw: calls.append((args[7], self.name, kw["QTYPE"],
                                                     kw["QTYPE2"]))

    monkeypatch.setattr(qint_mma, "qint_mma_launch", fake)
    monkeypatch.setattr(qint, "launcher", Grid)
    monkeypatch.setattr(qint, "mma_path", lambda m, qt, qt2, backend, device: m <= 16)
    n, k = 128, 1024
    v = qint.repack_q6k(random_weight(T.Q6_K, 64, k, rng), k)
    qk = random_weight(T.Q4_K, n, k, rng)
    for m in (3, 6):
        x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
        xq = quant_x.QuantX(*(t.zero_() for t in quant_x.empty_quant_x(m, k, x.device)))
        qint.qint_triton(x, qk, qint.Q4_K, (n, k), num_sms=132, xq=xq)
        qint.qint_triton(x, v, qint.Q6_K_A, (64, k), num_sms=132, xq=xq)
        qint.qint_parts(x, [(qk, qint.Q4_K, n), (v, qint.Q6_K_A, 64)], k, num_sms=132, xq=xq)
    assert calls == [(3, "mma", False, False), (3, "_qint_gemv_kernel", qint.Q6_K_A, 0),
                     (3, "mma", False, True),
                     (6, "mma", False, False), (6, "mma", True, False), (6, "mma", False, True)]


def test_qint_launch_hands_over_the_split_and_the_counters(monkeypatch, rng):  # noqa: F811
    """Where mma_path holds, qint_triton's launch returns this kernel's output, given the
    quantized x, the weight as held, the split of qint's own launch (a row's bits depend on
    it) and qgemv's ticket counters."""
    from kernels import qint

    calls = []

    def fake(xq, blocks, n, k, split, tickets=None, *, q6=False, second=None, launch=None,
             **kw):
        calls.append((xq.q.shape, blocks.data_ptr(), n, k, split, tickets is not None, q6,
                      second and (second[0].data_ptr(), second[1]), callable(launch)))
        return torch.full((xq.q.shape[0], n), 7.0)

    monkeypatch.setattr(qint_mma, "qint_mma_launch", fake)
    monkeypatch.setattr(qint, "mma_path", lambda m, qt, qt2, backend, device: True)
    n, k, m = 320, 2048, 12
    for qtype in (qint.Q4_K, qint.Q6_K_A):
        calls.clear()
        blocks = random_weight(T.Q4_K if qtype == qint.Q4_K else T.Q6_K, n, k, rng)
        held = blocks if qtype == qint.Q4_K else qint.repack_q6k(blocks, k)
        x = torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
        xq = quant_x.QuantX(*(t.zero_() for t in quant_x.empty_quant_x(m, k, x.device)))
        y = qint.qint_triton(x, held, qtype, (n, k), num_sms=132, xq=xq)
        split = qint.default_qint_config(qtype, n, k, 132, m=m).split
        assert torch.equal(y, torch.full((m, n), 7.0))
        assert calls == [((m, k), held.data_ptr(), n, k, split, True, qtype == qint.Q6_K_A,
                          None, True)]
    # q|k (Q4_K, a multiple of 64 rows) and v (Q6_K_A) as one launch; the whole weight's
    # split
    calls.clear()
    v = qint.repack_q6k(random_weight(T.Q6_K, 64, k, rng), k)
    qk = random_weight(T.Q4_K, n, k, rng)
    y = qint.qint_parts(x, [(qk, qint.Q4_K, n), (v, qint.Q6_K_A, 64)], k, num_sms=132, xq=xq)
    split = qint.default_qint_config(qint.Q4_K, n + 64, k, 132, m=m).split
    assert torch.equal(y, torch.full((m, n + 64), 7.0))
    assert calls == [((m, k), qk.data_ptr(), n + 64, k, split, True, False,
                      (v.data_ptr(), n), True)]


def test_two_type_launch_refuses_a_q4k_part_that_does_not_fill_its_tiles(rng):  # noqa: F811
    """The two-type launch needs the Q4_K part's rows in whole tiles (16 warps) and a
    Q6_K part after it: a clear error before anything launches."""
    from kernels import qint

    k, m = 1024, 9
    xq = quant_x.QuantX(*(t.zero_() for t in quant_x.empty_quant_x(m, k, torch.device("cpu"))))
    qk = random_weight(T.Q4_K, 100, k, rng)
    v = qint.repack_q6k(random_weight(T.Q6_K, 64, k, rng), k)
    for n1, n in ((100, 164), (128, 128), (0, 64)):
        with pytest.raises(ValueError, match="multiple of 64"):
            qint_mma.qint_mma_launch(xq, qk, n, k, 1, second=(v, n1))


def default_tile(m: int) -> tuple:
    """qint's default matrix-unit tile at m rows (its bound's first candidate)."""

    return qint_mm.TILE_CANDIDATES["cuda"][next(b for b in qint_mm.TILE_BOUNDS if m <= b)][0]


@pytest.mark.gpu
def test_gpu_same_bits_as_qint(rng):  # noqa: F811 - the fixture
    """On the GPU, at rows that leave x's tile partly filled and N that leaves the last
    program partly filled, each split the shape allows, with and without the tickets:
    _qint_mm_kernel's bits at its own split (its default tile forced), the engine's launch
    (qint_triton) taking this kernel, and within 2^-16 of the definition at every split;
    the two-type launch (q|k in Q4_K, v in Q6_K) likewise."""
    if not torch.cuda.is_available():
        pytest.fail("no GPU: run the gpu tests on the device")
    from kernels import qint
    from kernels.qgemv import _tickets

    cases = [(T.Q4_K, 1000, 2048, (3, 5, 9, 13, 16, 17, 32, 45, 64)),
             (T.Q4_K, 320, 14336, (3, 5, 9, 16, 30, 64)),
             (T.Q6_K, 1000, 2048, (5, 8, 9, 13, 16, 20, 33, 64)),
             (T.Q6_K, 320, 14336, (5, 9, 16, 32, 50))]
    for qtype, n, k, rows in cases:
        blocks = random_weight(qtype, n, k, rng)
        q6 = qtype == T.Q6_K
        held_type = qint.Q6_K_A if q6 else qint.Q4_K
        held = (qint.repack_q6k(blocks, k) if q6 else blocks).cuda()
        x = torch.from_numpy(rng.standard_normal((64, k), dtype=np.float32))
        for m in rows:
            xq = quant_x.quantize_x(x[:m].cuda())
            split = qint.default_qint_config(held_type, n, k, num_sms(held.device),
                                             m=m).split
            with qint_mm.forced_tile(default_tile(m)):
                want = qint.qint_triton(x[:m].cuda(), held, held_type, (n, k), xq=xq).cpu()
            got = qint.qint_triton(x[:m].cuda(), held, held_type, (n, k), xq=xq).cpu()
            assert torch.equal(got, want), (qtype, n, k, m)
            for warps, stages in ((4, 2), (4, 3), (8, 2)) if m <= 16 else ((4, 2),):
                for s in sorted({1, 2, split, k // 256}):
                    if (k // 256) % s:
                        continue
                    for tickets in (_tickets(held.device), None):
                        y = qint_mma.qint_mma_launch(xq, held, n, k, s, tickets, q6=q6,
                                                     warps=warps, stages=stages).cpu()
                        check(y, x[:m], blocks, qtype)
                        if s == split:
                            assert torch.equal(y, want), (qtype, n, k, m, warps, stages, s)
    # q|k (Q4_K) and v (Q6_K) in one launch: each part's bits as qint's two-type launch
    # (forced tile) and within 2^-16 of its definition
    for n1, n2, k in ((320, 64, 2048), (640, 200, 4096)):
        g1, g2 = random_weight(T.Q4_K, n1, k, rng), random_weight(T.Q6_K, n2, k, rng)
        parts = [(g1.cuda(), qint.Q4_K, n1), (qint.repack_q6k(g2, k).cuda(), qint.Q6_K_A, n2)]
        x = torch.from_numpy(rng.standard_normal((64, k), dtype=np.float32))
        for m in (3, 6, 9, 16, 24, 64):
            xq = quant_x.quantize_x(x[:m].cuda())
            with qint_mm.forced_tile(default_tile(m)):
                want = qint.qint_parts(x[:m].cuda(), parts, k, xq=xq).cpu()
            got = qint.qint_parts(x[:m].cuda(), parts, k, xq=xq).cpu()
            assert torch.equal(got, want), (n1, n2, k, m)
            check(got[:, :n1], x[:m], g1, T.Q4_K)
            check(got[:, n1:], x[:m], g2, T.Q6_K)
