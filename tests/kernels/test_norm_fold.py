"""The folded norm (MBUFO_NORM_FOLD): kernels/fused_norm.py's add_norm_folded (h, y = h * w
quantized, the sums of h^2 a super-block) in the interpreter against float64, and the rope
and activation kernels that take its scale (fold_scale) against the same kernels on
inputs scaled in float64 first: a product of the folded y times the scale is the product
of the norm."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequest
from kernels.fused_norm import fold_scale_reference
from kernels.qint import quant_x_reference

EPS = 1e-5


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def scale64(h: torch.Tensor) -> torch.Tensor:
    h = h.double()
    return 1.0 / torch.sqrt((h * h).mean(-1) + EPS)


@pytest.mark.parametrize("rows,dim,residual", [(1, 4096, True), (3, 768, True), (2, 512, False)])
def test_folded_norm_against_float64(interp, gen, rows, dim, residual):
    x = torch.randn(rows, dim, generator=gen) * 3
    r = torch.randn(rows, dim, generator=gen) * 5 if residual else None
    w = torch.rand(dim, generator=gen) + 0.5
    out, sumsq = interp.call("kernels.fused_norm:add_norm_folded", x, w, r)
    h64 = x.double() + (r.double() if residual else 0.0)
    assert torch.isfinite(out.y).all() and torch.isfinite(sumsq).all()
    assert torch.equal(out.h, x + r if residual else x)
    assert torch.equal(out.y, out.h * w)
    q, dx = quant_x_reference(out.y)[:2]
    assert torch.equal(out.xq.q.int(), q.int()) and torch.equal(out.xq.dx, dx)
    want = (h64 * h64).reshape(rows, dim // 256, 256).sum(-1)
    assert torch.allclose(sumsq.double(), want, rtol=1e-5, atol=0)
    # the scale the consumers apply, times y: the norm
    norm = out.y.double() * fold_scale_reference(sumsq, EPS).double()[:, None]
    ref = h64 * scale64(h64)[:, None] * w.double()
    assert torch.allclose(norm, ref, rtol=1e-5, atol=1e-6)


def test_folded_norm_rejects_bad_inputs(interp):
    with pytest.raises(InvalidRequest, match="multiple of 256"):
        interp.call("kernels.fused_norm:add_norm_folded", torch.ones(1, 300), torch.ones(300))


def folded_case(gen, tokens: int, hidden: int):
    """A folded norm's sums for `tokens` rows of `hidden` columns, and their scales."""
    h = torch.randn(tokens, hidden, generator=gen) * 4
    sumsq = (h * h).reshape(tokens, hidden // 256, 256).sum(-1).contiguous()
    return sumsq, fold_scale_reference(sumsq, EPS)


@pytest.mark.parametrize("k_format,v_format", [("f16", "f16"), ("q8", "q4")])
def test_rope_with_fold_is_rope_of_the_scaled_inputs(interp, gen, k_format, v_format):
    """rope_qk with `fold` (and its K/V store) against rope_qk of q, k, v scaled first."""
    from test_kv_store import clone, random_planes

    tokens, heads, kv_heads, dim = 3, 4, 2, 64
    q = torch.randn(tokens, heads, dim, generator=gen)
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    sumsq, s = folded_case(gen, tokens, 1280)  # 5 super-blocks: a padded sum
    slots = torch.randperm(2 * tokens, generator=gen)[:tokens]
    k_planes = random_planes(gen, k_format, 2 * tokens, kv_heads, dim)
    v_planes = random_planes(gen, v_format, 2 * tokens, kv_heads, dim)
    sc = s[:, None, None]
    got_q, got_k, got_kp, got_vp = interp.call(
        "test_norm_fold:stored", q, k, cos, sin, v, slots, clone(k_planes), clone(v_planes),
        k_format, v_format, sumsq)
    want_q, want_k, want_kp, want_vp = interp.call(
        "test_norm_fold:stored", q * sc, k * sc, cos, sin, (v * sc).contiguous(), slots,
        clone(k_planes), clone(v_planes), k_format, v_format, None)
    assert torch.allclose(got_q, want_q, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got_k, want_k, rtol=1e-6, atol=1e-6)
    plain_q = interp.call("kernels.fused_rope:rope_qk", q, k, cos, sin, False)[0]
    assert not torch.allclose(got_q, plain_q, rtol=1e-2)  # the scale matters
    for got, want, fmt in ((got_kp, want_kp, k_format), (got_vp, want_vp, v_format)):
        assert set(got) == set(want)
        for name in got:
            a, b = got[name], want[name]
            if a.dtype == torch.float16:  # values (f16) or scales: the scale's rounding
                assert torch.allclose(a.float(), b.float(), rtol=2e-3, atol=1e-6,
                                      equal_nan=True), (fmt, name)
            else:  # codes: one step apart at most, where a rounding tie moved
                diff = (a.int() - b.int()).abs()
                if fmt.startswith("q4"):  # two codes a byte
                    diff = torch.maximum(((a.int() & 15) - (b.int() & 15)).abs(),
                                         ((a.int() >> 4) - (b.int() >> 4)).abs())
                assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.02, (
                    fmt, name)


def stored(q, k, cos, sin, v, slots, k_planes, v_planes, k_format, v_format, sumsq):
    """rope_qk with a store (and `fold` where sumsq is given), in the worker: -> q, k and
    the planes it wrote into."""
    from kernels.fused_rope import KVStore, rope_qk

    q_out, k_out = rope_qk(q, k, cos, sin, False, None, None, EPS,
                           KVStore(v, slots, k_planes, v_planes, k_format, v_format),
                           None if sumsq is None else (sumsq, EPS))
    return q_out, k_out, k_planes, v_planes


@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_activation_with_fold_is_the_activation_of_the_scaled_rows(interp, gen, activation):
    rows, ffn = 2, 512
    gu = torch.randn(rows, 2 * ffn, generator=gen) * 3
    sumsq, s = folded_case(gen, rows, 4096)
    got, gq = interp.call("kernels.gated_act:gated_act_quant", gu, activation, torch.float32,
                          (sumsq, EPS))
    want, wq = interp.call("kernels.gated_act:gated_act_quant", gu * s[:, None], activation)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    codes = (gq.q.int() - wq.q.int()).abs()
    assert int(codes.max()) <= 1 and float((codes > 0).float().mean()) < 0.01
    with pytest.raises(InvalidRequest, match="fold"):
        interp.call("kernels.gated_act:gated_act_quant", gu, activation, torch.float32,
                    (sumsq[:1], EPS))


@pytest.mark.gpu
def test_gpu_folded_norm_and_its_consumers_at_llama_width(gen):
    """On the device, Llama-3.1-8B's widths: the folded norm against float64, and the
    activation with its scale against the activation of the norm's product."""
    from kernels.fused_norm import add_norm_folded
    from kernels.gated_act import gated_act_quant

    dev = torch.device("cuda")
    x, r = (torch.randn(1, 4096, generator=gen).to(dev) * 3 for _ in range(2))
    w = (torch.rand(4096, generator=gen) + 0.5).to(dev)
    out, sumsq = add_norm_folded(x, w, r)
    h64 = (x + r).double().cpu()
    assert torch.equal(out.h, x + r) and torch.equal(out.y, out.h * w)
    q, dx = quant_x_reference(out.y.cpu())[:2]
    assert torch.equal(out.xq.q.cpu().int(), q.int()) and torch.equal(out.xq.dx.cpu(), dx)
    scale = fold_scale_reference(sumsq, EPS)
    assert torch.allclose(scale.double().cpu(), scale64(h64), rtol=1e-5)
    gu = torch.randn(1, 2 * 14336, generator=gen).to(dev)
    got, gq = gated_act_quant(gu, "silu", torch.float32, (sumsq, EPS))
    want, _ = gated_act_quant(gu * scale[:, None], "silu")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_folded_norm_feeds_q8_products_without_a_bias():
    """Qwen2's q|k|v carry biases: the kernel after the product scales all of its output,
    so a folded norm feeds only q8 products without one."""
    from types import SimpleNamespace

    from engine.models.common import _foldable

    q8 = SimpleNamespace(takes_xq=True, bias=None)
    assert _foldable(q8, True)
    assert not _foldable(SimpleNamespace(takes_xq=True, bias=torch.ones(4)), True)
    assert not _foldable(SimpleNamespace(takes_xq=False, bias=None), True)  # bf16 layout
    assert not _foldable(q8, False)  # the torch path
