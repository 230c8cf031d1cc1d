"""rope_qk's kernel (interpreted on the CPU, outputs poisoned with NaN by the worker) and its
torch reference against engine/layers/rope.py's Rope.apply run in float64 (on the float32
cos/sin tables Rope.cos_sin gives the model), with the q/k RMSNorm written here in
float64; both pair layouts, GQA, odd token counts, q and k read as strided views of a
fused qkv row as the decoder passes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequest
from engine.layers.rope import Rope
from kernels.fused_rope import rope_qk, rope_qk_reference

KERNEL = "kernels.fused_rope:rope_qk"
EPS = 1e-6


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def case(gen, tokens: int, heads: int, kv_heads: int, dim: int, neox: bool):
    """q, k as views of one (T, (H + 2 KVH) d) qkv row; the model's cos/sin; the Rope."""
    rope = Rope(dim, 10000.0, neox)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 2
    q = qkv[:, :heads * dim].reshape(tokens, heads, dim)
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens, kv_heads, dim)
    positions = torch.randint(0, 40000, (tokens,), generator=gen)
    cos, sin = rope.cos_sin(positions)  # (T, 1, d/2) float32
    return rope, q, k, cos, sin


def expected(rope, x, cos, sin, w):
    x = x.double()
    if w is not None:
        x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w.double()
    return rope.apply(x, cos.double(), sin.double())


def assert_close32(got: torch.Tensor, want: torch.Tensor) -> None:
    assert torch.isfinite(got).all(), "output not fully written"
    assert got.is_contiguous() and got.shape == want.shape
    tol = 4e-6 * want.abs().amax(-1, keepdim=True)
    err = (got.double() - want).abs()
    assert (err <= tol).all(), float((err / tol).max())


@pytest.mark.parametrize("tokens,heads,kv_heads,dim,neox,norm", [
    (1, 4, 2, 64, False, False), (7, 4, 1, 64, True, False), (13, 6, 2, 32, False, True),
    (5, 3, 3, 96, True, True), (2, 32, 8, 128, False, False)])
def test_kernel_matches_float64(interp, gen, tokens, heads, kv_heads, dim, neox, norm):
    rope, q, k, cos, sin = case(gen, tokens, heads, kv_heads, dim, neox)
    qw, kw = ((torch.rand(dim, generator=gen) + 0.5) for _ in range(2)) if norm else (None,) * 2
    got_q, got_k = interp.call(KERNEL, q, k, cos, sin, neox, qw, kw, EPS)
    assert_close32(got_q, expected(rope, q, cos, sin, qw))
    assert_close32(got_k, expected(rope, k, cos, sin, kw))


@pytest.mark.parametrize("neox,norm", [(False, False), (True, True)])
def test_reference_matches_float64(gen, neox, norm):
    rope, q, k, cos, sin = case(gen, 9, 4, 2, 64, neox)
    qw, kw = (torch.rand(64, generator=gen) + 0.5, torch.rand(64, generator=gen) + 0.5) \
        if norm else (None, None)
    got_q, got_k = rope_qk_reference(q, k, cos[:, 0], sin[:, 0], neox, qw, kw, EPS)
    assert_close32(got_q, expected(rope, q, cos, sin, qw))
    assert_close32(got_k, expected(rope, k, cos, sin, kw))


def test_wrapper_rejects_bad_inputs(interp, gen):
    rope, q, k, cos, sin = case(gen, 3, 4, 2, 64, True)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, q, k[:, :, :32], cos, sin, True)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, q, k, cos[:2], sin[:2], True)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, q, k, cos, sin, True, torch.ones(64), None)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, q.double(), k, cos, sin, True)


def test_cpu_without_interpreter_runs_the_reference(gen):
    rope, q, k, cos, sin = case(gen, 3, 4, 2, 64, False)
    got, ref = rope_qk(q, k, cos, sin, False), rope_qk_reference(q, k, cos, sin, False)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
