"""Empty kernels in the decoder's chain of launches, for engine_bench's `+padN` variants.

A decode step is a chain of a few hundred dependent kernels (engine/models/common.py);
what one launch adds to that chain beyond its own work is what fusing two kernels could
save at best. `padded_norms(n)` launches `n` empty kernels after each fused norm (two a
layer and the output norm), the way the engine launches its own: compiled, and as
programmatic dependent launches inside graph captures (each waits for the kernel before it
and lets the next one start, kernels/triton_util.py's `await_inputs`). The step's growth
over the unpadded variant, divided by the kernels added a step, is the cost of one
boundary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kernels.triton_util import HAS_TRITON, await_inputs, jit, launcher, tl

if HAS_TRITON:

    @jit
    def _pad_kernel(PDL: tl.constexpr = False):
        """Nothing but its place in the chain."""
        await_inputs(PDL)


def pad_count(variant: str) -> int:
    """N of a `+padN` part of an engine_bench variant name (0 without one)."""
    for part in variant.split("+")[1:]:
        if part.startswith("pad") and part[3:].isdigit():
            return int(part[3:])
    return 0


@contextlib.contextmanager
def padded_norms(count: int) -> Iterator[None]:
    """Inside, the decoder's fused norm launches `count` empty kernels after itself."""
    import engine.models.common as common

    original = common.add_rms_norm
    if count <= 0:
        yield
        return

    def padded(x, *args, **kwargs):
        out = original(x, *args, **kwargs)
        for _ in range(count):
            launcher(_pad_kernel, x.device)[(1,)]()
        return out

    common.add_rms_norm = padded
    try:
        yield
    finally:
        common.add_rms_norm = original
