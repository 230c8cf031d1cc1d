"""Programmatic dependent launches (kernels/triton_util.py): `launcher` adds the PDL
constexpr and the launch flag to kernels that take it, only where `pdl_enabled`, and
never elsewhere. The launch itself needs an sm_90 GPU (the GPU tests run with it on);
the builds' waits are checked in tests/kernels/test_aot.py."""

from __future__ import annotations

import pytest
import torch

from kernels import triton_util
from kernels.triton_util import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the CPU torch build has no Triton")


class _Fake:
    """Stands for a compiled kernel: records its launches."""

    def __init__(self, arg_names):
        self.arg_names = arg_names
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs))


@pytest.fixture
def gpu(monkeypatch):
    """A 'cuda' device whose PDL switch and graph capture the test sets; compiled() passes
    fakes through."""
    state = {"on": True, "capturing": True}
    monkeypatch.setattr(triton_util, "compiled", lambda kernel: kernel)
    monkeypatch.setattr(triton_util, "pdl_enabled", lambda device: state["on"])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    return state


def test_kernels_with_pdl_launch_as_dependent_launches(gpu):
    fake = _Fake(["x_ptr", "n", "PDL"])
    triton_util.launcher(fake, torch.device("cuda", 0))[(3, 2)](1, 2, BLOCK=8)
    assert fake.calls == [((3, 2), (1, 2), {"BLOCK": 8, "PDL": True, "launch_pdl": True})]


def test_no_flags_where_disabled_not_taken_or_not_captured(gpu):
    """Eager launches (prefill steps) stay plain: there cuBLAS's kernels let ours start
    early and take multiprocessors its GEMMs still need."""
    plain = _Fake(["x_ptr", "n"])
    triton_util.launcher(plain, torch.device("cuda", 0))[(1,)](1)
    gpu["on"] = False
    takes = _Fake(["x_ptr", "PDL"])
    triton_util.launcher(takes, torch.device("cuda", 0))[(1,)](1)
    gpu["on"], gpu["capturing"] = True, False
    eager = _Fake(["x_ptr", "PDL"])
    triton_util.launcher(eager, torch.device("cuda", 0))[(1,)](1)
    assert plain.calls == takes.calls == eager.calls == [((1,), (1,), {})]


def test_pdl_launches_outside_a_capture_for_the_warm_up(gpu):
    """Inside pdl_launches (the load-time warm-up building the mixed graphs' variants) a
    launch takes PDL as in a capture, where it is enabled; after it, eager launches are
    plain again, and another thread's never change."""
    import threading

    gpu["capturing"] = False
    inside, after, other = (_Fake(["x_ptr", "PDL"]) for _ in range(3))
    with triton_util.pdl_launches():
        triton_util.launcher(inside, torch.device("cuda", 0))[(1,)](1)
        thread = threading.Thread(
            target=lambda: triton_util.launcher(other, torch.device("cuda", 0))[(1,)](1))
        thread.start()
        thread.join()
    triton_util.launcher(after, torch.device("cuda", 0))[(1,)](1)
    assert inside.calls == [((1,), (1,), {"PDL": True, "launch_pdl": True})]
    assert after.calls == other.calls == [((1,), (1,), {})]
    gpu["on"] = False
    off = _Fake(["x_ptr", "PDL"])
    with triton_util.pdl_launches():
        triton_util.launcher(off, torch.device("cuda", 0))[(1,)](1)
    assert off.calls == [((1,), (1,), {})]


def test_pdl_needs_cuda_sm90_and_can_be_turned_off(monkeypatch):
    triton_util.pdl_enabled.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    try:
        assert triton_util.pdl_enabled(torch.device("cuda", 0))
        assert not triton_util.pdl_enabled(torch.device("cpu"))
        triton_util.pdl_enabled.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
        assert not triton_util.pdl_enabled(torch.device("cuda", 0))
        triton_util.pdl_enabled.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
        monkeypatch.setenv("MBUFO_PDL", "0")
        assert not triton_util.pdl_enabled(torch.device("cuda", 0))
        triton_util.pdl_enabled.cache_clear()
        monkeypatch.delenv("MBUFO_PDL")
        monkeypatch.setattr(torch.version, "hip", "6.4")
        assert not triton_util.pdl_enabled(torch.device("cuda", 0))
    finally:
        triton_util.pdl_enabled.cache_clear()


def test_every_decode_kernel_takes_pdl():
    """The kernels of a decode step all take PDL: a plain launch among them would still be
    correct, but would cost its start-up again (and the step waits for it in full)."""
    from kernels import (
        fused_norm,
        fused_rope,
        gated_act,
        kv_store,
        moe,
        moe_route,
        paged_attention_triton,
        qgemv,
        qint_gemv,
        qint_mm,
        qmatmul,
        quant_x,
    )

    kernels = [fused_norm._add_rms_norm_kernel, fused_rope._rope_qk_kernel,
               gated_act._gated_act_kernel, kv_store._kv_store_kernel,
               paged_attention_triton._attn_partial_kernel,
               paged_attention_triton._attn_merge_kernel, qgemv._qgemv_kernel,
               quant_x._quantize_x_kernel, qint_gemv._qint_gemv_kernel,
               qint_mm._qint_mm_kernel,
               qmatmul._qmm_kernel, qmatmul._sum_splits_kernel,
               # a MoE block's (the combine runs in the norm's launch; the separate routing
               # launches are MBUFO_MOE_FUSED_ROUTE=0's)
               moe._moe_mm_kernel, moe_route._route_group_kernel, moe_route._group_blocks_kernel,
               moe_route._router_logits_kernel, moe_route._topk_kernel,
               moe_route._group_kernel, moe_route._combine_kernel]
    for kernel in kernels:
        assert "PDL" in triton_util.compiled(kernel).arg_names, kernel
