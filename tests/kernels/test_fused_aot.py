"""The decoder's small fused kernels (norm, RoPE, KV store, gated activation) build ahead of
time for hip:gfx1151 and cuda:90 at the configurations kernels/aot.py registers, and every
kernel of their modules is registered. Built here, in the test process (a few seconds);
tests/kernels/test_aot.py's background build covers them as well."""

from __future__ import annotations

import importlib
import inspect

import pytest

from kernels.triton_util import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="the CPU torch build has no Triton")
MODULES = ("kernels.fused_norm", "kernels.fused_rope", "kernels.kv_store", "kernels.gated_act",
           "kernels.gather_rows", "kernels.rotate")
TARGETS = ("hip:gfx1151", "cuda:90")


def specs():
    from kernels.aot import kernel_specs

    return [s for s in kernel_specs() if s.kernel.__module__ in MODULES]


def test_every_fused_kernel_is_registered():
    from triton.runtime.jit import JITFunction

    registered = {s.kernel.__name__ for s in specs()}
    for name in MODULES:
        module = importlib.import_module(name)
        kernels = {n for n, obj in inspect.getmembers(module)
                   if isinstance(obj, JITFunction) and n.endswith("_kernel")}
        assert kernels and kernels <= registered, (name, kernels - registered)


@pytest.mark.parametrize("target", TARGETS)
def test_fused_kernels_build(target):
    from kernels.aot import build, check_asm

    for spec in specs():
        info = check_asm(spec, target, build(spec, target))
        assert not info["problems"] and info["binary_bytes"] > 0, (spec.name, target, info)
        if target.startswith("hip"):
            assert info["vgpr_spills"] == 0, (spec.name, info["vgpr_spills"])
