"""MBUFO_PDL_RELEASE_FIRST (kernels/triton_util.py): the kernels right before a quantized
product may let it start before their own wait. The setting's checks, what the launches
pass, and the order of the two PDL instructions in the sm_90 builds."""

from __future__ import annotations

import pytest
import torch

from kernels import gated_act, quant_x
from kernels.triton_util import HAS_TRITON, release_first

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the CPU torch build has no Triton")


def test_setting(monkeypatch):
    monkeypatch.delenv("MBUFO_PDL_RELEASE_FIRST", raising=False)
    assert not release_first("quantize_x") and not release_first("gated_act")
    monkeypatch.setenv("MBUFO_PDL_RELEASE_FIRST", " quantize_x ,")
    assert release_first("quantize_x") and not release_first("gated_act")
    monkeypatch.setenv("MBUFO_PDL_RELEASE_FIRST", "quantize_x,gated_act")
    assert release_first("quantize_x") and release_first("gated_act")
    monkeypatch.setenv("MBUFO_PDL_RELEASE_FIRST", "quantize_x,rope")
    with pytest.raises(ValueError, match="unknown kernel.*rope.*known: quantize_x, gated_act"):
        release_first("quantize_x")


class _Fake:
    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


@pytest.mark.parametrize("setting", ["", "quantize_x", "gated_act", "quantize_x,gated_act"])
def test_launches_pass_it_where_named(monkeypatch, setting):
    """quantize_x and gated_act's quantizing launch take RELEASE_FIRST where named;
    gated_act without quantization never (its output is no product's input)."""
    fakes: dict[str, _Fake] = {}

    def launch(kernel, device):
        return fakes.setdefault(kernel.fn.__name__ if hasattr(kernel, "fn") else
                                kernel.__name__, _Fake())

    monkeypatch.setenv("MBUFO_PDL_RELEASE_FIRST", setting)
    monkeypatch.setattr(quant_x, "launcher", launch)
    monkeypatch.setattr(gated_act, "launcher", launch)
    monkeypatch.setattr(gated_act, "kernels_run", lambda device: True)
    x = torch.zeros(1, 512)
    quant_x.quantize_x(x)
    gated_act.gated_act_quant(torch.zeros(1, 1024), "silu")
    gated_act.gated_act(torch.zeros(1, 1024), "silu")
    q, act = fakes["_quantize_x_kernel"].calls, fakes["_gated_act_kernel"].calls
    assert [c.get("RELEASE_FIRST", False) for c in q] == ["quantize_x" in setting]
    assert [c.get("RELEASE_FIRST", False) for c in act] == ["gated_act" in setting, False]


def _ptx(kernel, signature, consts) -> str:
    from kernels.aot import KernelSpec, build

    return build(KernelSpec("k", kernel, {**signature, **{k: "constexpr" for k in consts}},
                            consts, 2, False), "cuda:90").asm["ptx"]


@pytest.mark.parametrize("which", ["quantize_x", "gated_act"])
def test_builds_release_before_or_after_their_wait(which):
    if which == "quantize_x":
        kernel = quant_x._quantize_x_kernel
        sig = {"x_ptr": "*fp32", "q_ptr": "*i8", "dx_ptr": "*fp32", "bs_ptr": "*fp16",
               "K": "i32", "stride_xm": "i32"}
        base = {}
    else:
        kernel = gated_act._gated_act_kernel
        sig = {"gu_ptr": "*fp32", "out_ptr": "*fp32", "q_ptr": "*i8", "dx_ptr": "*fp32",
               "bs_ptr": "*fp16", "ffn": "i32", "stride_gu": "i32", "stride_out": "i32"}
        base = {"ACT": 0, "BLOCK": 1024, "QUANT": True}
    for first in (False, True):
        ptx = _ptx(kernel, sig, {**base, "PDL": True, "RELEASE_FIRST": first})
        wait = ptx.index("griddepcontrol.wait")
        release = ptx.index("griddepcontrol.launch_dependents")
        assert (release < wait) == first, (which, first)
        assert ptx.count("griddepcontrol.wait") == 1
