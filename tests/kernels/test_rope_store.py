"""rope_qk_store's kernel (interpreted on the CPU, buffers poisoned with NaN by the worker)
bit for bit against the two launches it replaces (rope_qk's and kv_store's kernels) on
planes that start out as random bytes (a missed or stray write shows), for several K/V
format pairs, both pair layouts, q/k norms, GQA and strided q/k/v views of a qkv row; and
its q and stored K against engine/layers/rope.py's Rope.apply in float64."""

from __future__ import annotations

import pytest
import torch
from test_fused_rope import EPS, case, expected
from test_kv_store import clone, random_planes, same_bits

from engine.errors import InvalidRequest
from kernels.fused_rope import rope_qk
from kernels.kv_store import kv_store
from kernels.rope_store import rope_qk_store, rope_qk_store_reference


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def fused(q, k, v, cos, sin, neox, slots, k_planes, v_planes, k_format, v_format, qw, kw):
    """rope_qk_store in the worker (called by name) -> (q, planes it wrote into)."""
    q_out = rope_qk_store(q, k, v, cos, sin, neox, slots, k_planes, v_planes, k_format,
                          v_format, qw, kw, EPS)
    return q_out, k_planes, v_planes


def separate(q, k, v, cos, sin, neox, slots, k_planes, v_planes, k_format, v_format, qw, kw):
    """The two launches it replaces, in the worker."""
    q_out, k_out = rope_qk(q, k, cos, sin, neox, qw, kw, EPS)
    kv_store(k_out, v, slots, k_planes, v_planes, k_format, v_format)
    return q_out, k_planes, v_planes


def make(gen, tokens, heads, kv_heads, dim, neox, norm, k_format, v_format):
    rope, q, k, cos, sin = case(gen, tokens, heads, kv_heads, dim, neox)
    v = torch.randn(tokens, kv_heads, dim + 5, generator=gen)[..., :dim]  # strided rows
    qw, kw = ((torch.rand(dim, generator=gen) + 0.5) for _ in range(2)) if norm else (None,) * 2
    slots = torch.randperm(3 * tokens, generator=gen)[:tokens]
    k_planes = random_planes(gen, k_format, 3 * tokens, kv_heads, dim)
    v_planes = random_planes(gen, v_format, 3 * tokens, kv_heads, dim)
    return rope, (q, k, v, cos, sin, neox, slots), k_planes, v_planes, qw, kw


@pytest.mark.parametrize("tokens,heads,kv_heads,dim,neox,norm,k_format,v_format", [
    (1, 4, 2, 64, False, False, "f16", "f16"), (5, 4, 1, 64, True, True, "q8", "q4"),
    (3, 6, 2, 32, False, True, "q4", "q8"), (2, 8, 2, 64, True, False, "q8_plain", "q8"),
    (4, 32, 8, 128, False, False, "q8", "q8")])
def test_bit_equal_to_the_two_launches(interp, gen, tokens, heads, kv_heads, dim, neox, norm,
                                       k_format, v_format):
    _, args, k_planes, v_planes, qw, kw = make(gen, tokens, heads, kv_heads, dim, neox, norm,
                                               k_format, v_format)
    got = interp.call("test_rope_store:fused", *args, clone(k_planes), clone(v_planes),
                      k_format, v_format, qw, kw)
    want = interp.call("test_rope_store:separate", *args, clone(k_planes), clone(v_planes),
                       k_format, v_format, qw, kw)
    assert torch.isfinite(got[0]).all() and torch.equal(got[0], want[0])
    assert same_bits(got[1], want[1]) and same_bits(got[2], want[2])
    assert not same_bits(got[1], k_planes)  # it wrote something


@pytest.mark.parametrize("neox,norm", [(False, False), (True, True)])
def test_matches_float64_rope(interp, gen, neox, norm):
    """q and the stored K (f16 planes: one rounding) against Rope.apply in float64; V as given."""
    rope, args, k_planes, v_planes, qw, kw = make(gen, 6, 8, 2, 64, neox, norm, "f16", "f16")
    q, k, v, cos, sin, _, slots = args
    got_q, got_k, got_v = interp.call("test_rope_store:fused", *args, k_planes, v_planes,
                                      "f16", "f16", qw, kw)
    want_q = expected(rope, q, cos, sin, qw)
    assert ((got_q.double() - want_q).abs() <= 4e-6 * want_q.abs().amax(-1, keepdim=True)).all()
    want_k = expected(rope, k, cos, sin, kw)
    stored = got_k["data"][slots].double()
    assert ((stored - want_k).abs() <= 2**-10 * want_k.abs() + 1e-7).all()
    assert torch.equal(got_v["data"][slots], v.half())


def test_reference_path_on_cpu(gen):
    """Without the interpreter: the reference, the same q and planes as its two parts."""
    _, args, k_planes, v_planes, qw, kw = make(gen, 3, 4, 2, 64, True, True, "q8", "q4")
    ref_k, ref_v = clone(k_planes), clone(v_planes)
    q_out = rope_qk_store(*args, k_planes, v_planes, "q8", "q4", qw, kw, EPS)
    want = rope_qk_store_reference(*args, ref_k, ref_v, "q8", "q4", qw, kw, EPS)
    assert torch.equal(q_out, want) and same_bits(k_planes, ref_k) and same_bits(v_planes, ref_v)


def test_bad_input_is_refused(interp, gen):
    _, args, k_planes, v_planes, qw, kw = make(gen, 3, 4, 2, 64, False, False, "q8", "q8")
    q, k, v, cos, sin, neox, slots = args
    with pytest.raises(InvalidRequest, match="v"):
        interp.call("test_rope_store:fused", q, k, v[:2], cos, sin, neox, slots, k_planes,
                    v_planes, "q8", "q8", qw, kw)
    with pytest.raises(InvalidRequest, match="slots"):
        interp.call("test_rope_store:fused", q, k, v, cos, sin, neox, slots[:2], k_planes,
                    v_planes, "q8", "q8", qw, kw)
    with pytest.raises(InvalidRequest, match="format"):
        interp.call("test_rope_store:fused", q, k, v, cos, sin, neox, slots, k_planes,
                    v_planes, "q8", "q5", qw, kw)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,k_format,v_format", [(1, "f16", "f16"), (7, "q8", "q4"),
                                                      (300, "q8", "q8")])
def test_gpu_bit_equal_to_the_two_launches(gen, tokens, k_format, v_format):
    """On the device (the barrier between the k rows' stores and their encoding is real
    there): Llama 3 8B's heads, the same bits as the two launches."""
    if not torch.cuda.is_available():
        pytest.fail("marked gpu: run on a GPU machine with pytest -m gpu")
    _, args, k_planes, v_planes, qw, kw = make(gen, tokens, 32, 8, 128, False, True, k_format,
                                               v_format)
    dev = [a.cuda() if isinstance(a, torch.Tensor) else a for a in (*args, qw, kw)]
    *args, qw, kw = dev
    planes = [{n: p.cuda() for n, p in ps.items()} for ps in (k_planes, v_planes)]
    got = fused(*args, clone(planes[0]), clone(planes[1]), k_format, v_format, qw, kw)
    want = separate(*args, clone(planes[0]), clone(planes[1]), k_format, v_format, qw, kw)
    torch.cuda.synchronize()
    assert torch.equal(got[0], want[0])
    assert same_bits(got[1], want[1]) and same_bits(got[2], want[2])
    assert not same_bits(got[1], planes[0])
