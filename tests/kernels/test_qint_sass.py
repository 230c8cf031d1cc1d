"""The one-row CUDA-core builds of kernels/qint.py for sm_90 (no device needed): every
global load of a super-block (the weights', x's words, sums and scale) issues before the
first barrier of its loop. A barrier is where the scales' decode hands the head's words
through shared memory, which waits on the weights; a load of x behind it adds its
latency to theirs on every super-block (H200, one stream: 424 -> 434 tok/s when they
moved ahead, bench/RESULTS.md)."""

from __future__ import annotations

import functools
import re

import pytest

from kernels import qint

LINE = re.compile(r"\s+/\*([0-9a-f]{4})\*/\s+(.*?);")


@functools.cache
def cubin(name: str) -> bytes:
    """The cuda:90 build of aot spec `name` (built once)."""
    from kernels import aot

    spec = next(s for s in qint.aot_specs(aot.KernelSpec) if s.name == name
                and s.backend == "cuda")
    return aot.build(spec, "cuda:90").asm["cubin"]


def loop_ops(name: str) -> list[str]:
    """The instructions of the longest loop (the super-block loop) of aot spec `name`'s
    cuda:90 build, in order."""
    from kernels import aot

    sass = aot.cuobjdump(cubin(name), "-sass")
    assert sass, "Triton ships cuobjdump"
    ops = [(int(m.group(1), 16), m.group(2).strip()) for m in map(LINE.match, sass.splitlines())
           if m]
    loops = [(at - int(b.group(1), 16), int(b.group(1), 16), at) for at, op in ops
             if (b := re.search(r"BRA\s+0x([0-9a-f]+)", op)) and int(b.group(1), 16) < at]
    assert loops, "no loop in the build"
    _, start, end = max(loops)
    return [op for at, op in ops if start <= at <= end]


def loads_and_barriers(ops: list[str]) -> tuple[list[int], list[int]]:
    """Positions of the global loads and of the barriers among `ops`."""
    return ([i for i, op in enumerate(ops) if re.match(r"(@!?P\d+\s+)?LDG\b", op)],
            [i for i, op in enumerate(ops) if "BAR.SYNC" in op])


@pytest.mark.parametrize("name", ["qint_Q4_K_m1", "qint_Q4_K_m1_wide", "qint_Q6_K_m1",
                                  "qint_Q4_K_m1_in_cta", "qint_Q4_K_Q6_K_m1_in_cta"])
def test_one_row_loads_issue_before_the_loops_barriers(name):
    """(Q6_K's 128-row build, the output head's, still passes two barriers before x's
    loads: its scale words' conversion is placed ahead of them.)"""
    ops = loop_ops(name)
    loads, bars = loads_and_barriers(ops)
    weights = [i for i in loads if ".EF" in ops[i]]  # evict-first: the weights' words
    assert weights and bars and len(loads) > len(weights), (name, len(loads), len(bars))
    assert max(loads) < min(bars), (name, [ops[i] for i in loads if i > min(bars)])


def test_q6k_wide_one_row_build_without_early_x_takes_fewer_registers():
    """QIntConfig.x_early's trade (kernels/qint.py, Q6K_EARLY_WAVES): Q6_K's 128-row
    one-row build with x's loads in the loop holds fewer registers (more programs a
    multiprocessor) and issues some loads after a barrier, as the early build does not."""
    from kernels import aot

    regs = {name: aot._cubin_resources(cubin(name))["regs"]
            for name in ("qint_Q6_K_m1_wide", "qint_Q6_K_m1_wide_late")}
    assert regs["qint_Q6_K_m1_wide_late"] <= 128 < regs["qint_Q6_K_m1_wide"], regs
    loads, bars = loads_and_barriers(loop_ops("qint_Q6_K_m1_wide_late"))
    assert bars and max(loads) > min(bars)
