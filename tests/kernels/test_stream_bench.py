"""bench/gpu/stream_bench.py on the CPU: x's words in the order its quads read them (against
Q4_K's layout written out here), and its ring kernel built for sm_90 as the bench runs it:
every weight copy 16 bytes (cp.async.cg), no more than one barrier for a slot's copies."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu"


@pytest.fixture(scope="module")
def stream_bench():
    sys.path[:0] = [str(BENCH)]
    try:
        import stream_bench as module
    finally:
        sys.path.remove(str(BENCH))
    return module


def test_x_words_in_quad_order(stream_bench):
    """Word c of a Q4_K super-block's 128 code bytes holds bytes 4c .. 4c + 3 of group
    g = c // 8; byte 32 g + l has element 64 g + l in its low nibble and 64 g + 32 + l in
    its high one. So the low nibbles of word c meet x's elements 64 g + 4 (c % 8) + j, the
    high ones 32 further (GGML's Q4_K block, written out by hand)."""
    from kernels.quant_x import QuantX

    k = 512
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (1, k), dtype=torch.int8, generator=gen)
    xq = QuantX(q, torch.ones(1, k // 256), torch.zeros(1, k // 16, dtype=torch.int32))
    lo, hi = stream_bench.quad_order_x(xq, k)
    lo_b, hi_b = lo.view(torch.int8).view(k // 256, 128), hi.view(torch.int8).view(k // 256, 128)
    for sb in range(k // 256):
        x = q[0, sb * 256:(sb + 1) * 256]
        for c in range(32):
            g, first = c // 8, 64 * (c // 8) + 4 * (c % 8)
            assert torch.equal(lo_b[sb, 4 * c:4 * c + 4], x[first:first + 4]), (sb, c, g)
            assert torch.equal(hi_b[sb, 4 * c:4 * c + 4], x[first + 32:first + 36]), (sb, c, g)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="the CPU torch build has no Triton")
def test_ring_builds_with_16_byte_copies(stream_bench):
    if not stream_bench.HAS_GLUON:
        pytest.fail("Triton without Gluon: the ring kernel cannot be built")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from kernels.triton_util import compiled, triton

    sig = {"w_ptr": "*u8", "xlo_ptr": "*i32", "xhi_ptr": "*i32", "bs_ptr": "*i32",
           "dx_ptr": "*fp32", "y_ptr": "*fp32", "ctr_ptr": "*i32", "N": "i32", "K": "i32",
           "layers": "i32", "WARPS": "constexpr", "S": "constexpr", "D": "constexpr",
           "WAIT": "constexpr", "PDL": "constexpr", "RT": "constexpr"}
    names = list(sig)
    aligned = ("w_ptr", "xlo_ptr", "xhi_ptr", "bs_ptr", "dx_ptr", "y_ptr", "ctr_ptr", "K")
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    for config in stream_bench.CONFIGS.split(","):
        warps, s, d, _, rt = (int(v) for v in config.split(":"))
        consts = {"WARPS": warps, "S": s, "D": d, "WAIT": True, "PDL": True, "RT": rt}
        src = GluonASTSource(compiled(stream_bench._ring_kernel), sig, consts, attrs)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": warps}).asm["ptx"]
        sizes = set(re.findall(r"cp\.async\.\w+\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)",
                               ptx))
        assert sizes == {"0x10"}, (config, sizes)
        assert "griddepcontrol.wait" in ptx, config  # the PDL build waits after its copies
