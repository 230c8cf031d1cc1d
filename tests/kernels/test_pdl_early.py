"""Early-releasing programmatic dependent launches (kernels/triton_util.py): which kernels
launch with PDL == PDL_EARLY, and what their sm_90 builds do first. A kernel so launched
lets the next kernel's programs start before its own wait for the kernel before it; it
must not release them a second time at its wait, and a normal PDL launch releases only
after its wait."""

from __future__ import annotations

import re

import pytest

from kernels.triton_util import EARLY_RELEASE, HAS_TRITON, early_release_kernels


def test_default_set_and_the_override(monkeypatch):
    monkeypatch.delenv("MBUFO_PDL_EARLY", raising=False)
    assert early_release_kernels() == frozenset(EARLY_RELEASE)
    monkeypatch.setenv("MBUFO_PDL_EARLY", "none")
    assert early_release_kernels() == frozenset()
    monkeypatch.setenv("MBUFO_PDL_EARLY", "")
    assert early_release_kernels() == frozenset()
    monkeypatch.setenv("MBUFO_PDL_EARLY", " _gated_act_kernel ,_quantize_x_kernel")
    assert early_release_kernels() == {"_gated_act_kernel", "_quantize_x_kernel"}
    monkeypatch.setenv("MBUFO_PDL_EARLY", "_qint_gemv_kernel")
    with pytest.raises(ValueError, match="_qint_gemv_kernel"):
        early_release_kernels()


needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="the CPU torch build has no Triton")


@needs_triton
def test_each_early_kernel_calls_release_next_before_its_wait():
    """Only kernels whose source releases early may be named (a PDL_EARLY launch of any
    other would release its dependents only at its exit)."""
    import inspect

    from kernels import fused_norm, gated_act, qint

    kernels = {k.fn.__name__: k for k in (fused_norm._add_rms_norm_kernel,
                                          gated_act._gated_act_kernel, qint._quantize_x_kernel)}
    assert set(kernels) == set(EARLY_RELEASE)
    for name, kernel in kernels.items():
        src = inspect.getsource(kernel.fn)
        assert 0 < src.find("release_next(PDL)") < src.find("await_inputs(PDL)"), name


def _ptx_order(name: str) -> list[str]:
    from kernels import aot

    spec = next(s for s in aot.kernel_specs() if s.name == name and s.backend != "hip")
    ptx = aot.build(spec, "cuda:90").asm["ptx"]
    return re.findall(r"griddepcontrol\.(wait|launch_dependents)", ptx)


@needs_triton
@pytest.mark.parametrize("name", ["add_rms_norm_add_q8_early", "gated_act_silu_q8_early",
                                  "qint_quantize_x_early"])
def test_early_builds_release_first_and_once(name):
    assert _ptx_order(name) == ["launch_dependents", "wait"]


@needs_triton
def test_a_normal_pdl_build_releases_after_its_wait():
    assert _ptx_order("qint_Q4_K_m1") == ["wait", "launch_dependents"]
