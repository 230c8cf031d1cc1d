"""The Hadamard rotation of 32-element blocks (engine/kv/hadamard.py), exact and row by row.

The rotated KV formats store every 32-block of K and V times H; attention rotates q once
before its kernel and its output once after (kernels/paged_attention.py). `rotate` does
both on the GPU path: a float64 Walsh-Hadamard butterfly (stages of distance 1, 2, 4, 8,
16), times 1/sqrt(32) in float64, rounded to float32 once: `rotate_exact`'s operations in
its order, so the two are bit-identical. kernels/kv_store.py rotates with the same helper
(`hadamard_blocks`) as it stores.

Why not a float32 matmul by H (as before): a GPU matmul library picks its kernel by the
row count, and its kernels may sum a block's 32 products in different orders, so a row's
rotated q, and with it its logits, could differ in a last bit alone and among other rows.
Here a row's bits depend on its own values only (DESIGN.md's batch invariance).
"""

from __future__ import annotations

import torch

from engine.errors import InvalidRequest
from engine.kv.hadamard import BLOCK, H_SCALE, rotate_exact
from kernels.triton_util import HAS_TRITON, await_inputs, helper, jit, kernels_run, launcher, tl

__all__ = ["aot_specs", "rotate", "rotate_exact"]

_BLOCKS = 32  # 32-element blocks a program rotates (1024 elements)

if HAS_TRITON:
    _H_SCALE = tl.constexpr(H_SCALE)

    @helper
    def hadamard_blocks(x, RP: tl.constexpr):
        """(RP, 32) float32 -> (RP, 32) float32 blocks times H (rotate_exact's order: the
        butterfly over the last of five binary axes, then the axes rotated by one)."""
        y = tl.reshape(x.to(tl.float64), (RP, 2, 2, 2, 2, 2))
        for _ in tl.static_range(5):
            a, b = tl.split(y)
            y = tl.permute(tl.join(a + b, a - b), (0, 5, 1, 2, 3, 4))
        return (tl.reshape(y, (RP, 32)) * tl.full((), _H_SCALE, tl.float64)).to(tl.float32)

    @jit
    def _rotate_kernel(x_ptr, out_ptr, stride_t, stride_h, HEADS: tl.constexpr,
                       NB: tl.constexpr, RP: tl.constexpr, PDL: tl.constexpr = False):
        """Blocks [RP j, RP (j + 1)) (program 1) of token t (program 0): block r is head
        r // NB's block r % NB; out is (T, HEADS * NB * 32) contiguous."""
        t = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1) * RP + tl.arange(0, RP)[:, None]
        j = tl.arange(0, 32)[None, :]
        ok = r < HEADS * NB
        await_inputs(PDL)
        b = tl.load(x_ptr + t * stride_t + (r // NB) * stride_h + (r % NB) * 32 + j, mask=ok,
                    other=0.0).to(tl.float32)
        tl.store(out_ptr + t * (HEADS * NB * 32) + r * 32 + j, hadamard_blocks(b, RP), mask=ok)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) float, D a multiple of 32 -> (T, H, D) float32 contiguous, every 32-block
    times H: one launch on a GPU (or on the CPU under the interpreter), else rotate_exact.
    H is its own inverse."""
    if x.dim() != 3 or x.shape[-1] % BLOCK or not x.dtype.is_floating_point:
        raise InvalidRequest(f"rotate: x must be (T, H, D) float with D a multiple of "
                             f"{BLOCK}, got {x.dtype} {tuple(x.shape)}")
    if not kernels_run(x.device) or x.dtype == torch.float64:
        return rotate_exact(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=torch.float32, device=x.device)
    blocks = heads * dim // BLOCK
    if tokens:
        launcher(_rotate_kernel, x.device)[(tokens, -(-blocks // _BLOCKS))](
            x, out, x.stride(0), x.stride(1), HEADS=heads, NB=dim // BLOCK,
            RP=min(_BLOCKS, 1 << (blocks - 1).bit_length()), num_warps=4)
    return out


def aot_specs(spec: type) -> list:
    """kernels/aot.py: Llama 3 8B's q (32 heads of 128) and a tiny model's (4 of 64)."""
    if not HAS_TRITON:
        return []
    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "stride_t": "i32", "stride_h": "i32",
           "HEADS": "constexpr", "NB": "constexpr", "RP": "constexpr"}
    return [spec(f"rotate_h{h}_d{d}", _rotate_kernel, sig,
                 {"HEADS": h, "NB": d // BLOCK, "RP": rp}, 4, False)
            for h, d, rp in ((32, 128, 32), (4, 64, 8))]
