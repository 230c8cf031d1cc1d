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
from engine.kv.hadamard import rotate_exact
from engine.layers.rope import Rope
from kernels.fused_rope import KVStore, rope_cos_sin_reference, rope_qk, rope_qk_reference
from kernels.kv_store import kv_store_reference

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


def rope_store(q, k, cos, sin, neox, qw, kw, v, slots, k_planes, v_planes, k_format,
               v_format):
    """rope_qk with its K/V store, in the worker: -> (q, k, the planes it wrote into)."""
    q_out, k_out = rope_qk(q, k, cos, sin, neox, qw, kw, EPS,
                           KVStore(v, slots, k_planes, v_planes, k_format, v_format))
    return q_out, k_out, k_planes, v_planes


@pytest.mark.parametrize("k_format,v_format", [("f16", "f16"), ("q8", "q4"),
                                               ("q4_plain", "q8")])
@pytest.mark.parametrize("tokens,heads,kv_heads,neox,norm", [(1, 4, 2, False, False),
                                                            (5, 6, 3, True, True)])
def test_store_is_rope_then_kv_store(interp, gen, k_format, v_format, tokens, heads, kv_heads,
                                     neox, norm):
    """With a KVStore, the launch gives rope_qk's q and k bit for bit and stores the rotated
    k and v as kv_store's reference does, every other byte of the planes untouched (they
    start as random bytes); v is a strided view of the qkv row, its head dim another. Into
    a Hadamard-rotated K format (q8, q4; not the _plain ones) q comes out rotated too, as
    rotate_exact rotates it."""
    from test_kv_store import clone, random_planes, same_bits

    dim, dv = 64, 96
    rope, q, k, cos, sin = case(gen, tokens, heads, kv_heads, dim, neox)
    qw, kw = ((torch.rand(dim, generator=gen) + 0.5) for _ in range(2)) if norm else (None,) * 2
    vrow = torch.randn(tokens, kv_heads * dv + 3, generator=gen)
    v = vrow[:, :kv_heads * dv].reshape(tokens, kv_heads, dv)
    slots = torch.randperm(3 * tokens, generator=gen)[:tokens]
    k_planes = random_planes(gen, k_format, 3 * tokens, kv_heads, dim)
    v_planes = random_planes(gen, v_format, 3 * tokens, kv_heads, dv)
    ref_k, ref_v = clone(k_planes), clone(v_planes)
    got_q, got_k, got_kp, got_vp = interp.call(
        "test_fused_rope:rope_store", q, k, cos, sin, neox, qw, kw, v, slots, k_planes,
        v_planes, k_format, v_format)
    want_q, want_k = interp.call(KERNEL, q, k, cos, sin, neox, qw, kw, EPS)
    if k_format in ("q8", "q4"):
        want_q = rotate_exact(want_q)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    kv_store_reference(want_k, v, slots, ref_k, ref_v, k_format, v_format)
    assert same_bits(got_kp, ref_k) and same_bits(got_vp, ref_v)


def test_store_rejects_bad_inputs(interp, gen):
    from test_kv_store import random_planes

    _, q, k, cos, sin = case(gen, 3, 4, 2, 64, False)
    v = torch.randn(3, 2, 64, generator=gen)
    planes = random_planes(gen, "f16", 9, 2, 64)
    with pytest.raises(InvalidRequest, match="slots"):
        interp.call(KERNEL, q, k, cos, sin, False, None, None, EPS,
                    KVStore(v, torch.arange(2), planes, planes, "f16", "f16"))
    with pytest.raises(InvalidRequest, match="format"):
        interp.call(KERNEL, q, k, cos, sin, False, None, None, EPS,
                    KVStore(v, torch.arange(3), planes, planes, "f16", "q5"))


def test_cpu_reference_path_stores_too(gen):
    """Without the interpreter (CPU tensors): the references, the store included."""
    from test_kv_store import clone, random_planes, same_bits

    _, q, k, cos, sin = case(gen, 3, 4, 2, 64, True)
    v = torch.randn(3, 2, 64, generator=gen)
    slots = torch.tensor([4, 0, 7])
    planes_k, planes_v = random_planes(gen, "q8", 9, 2, 64), random_planes(gen, "f16", 9, 2, 64)
    ref_k, ref_v = clone(planes_k), clone(planes_v)
    q_out, k_out = rope_qk(q, k, cos, sin, True, store=KVStore(v, slots, planes_k, planes_v,
                                                                "q8", "f16"))
    want_q, want_k = rope_qk_reference(q, k, cos, sin, True)
    assert torch.equal(q_out, rotate_exact(want_q)) and torch.equal(k_out, want_k)  # q8 K
    kv_store_reference(want_k, v, slots, ref_k, ref_v, "q8", "f16")
    assert same_bits(planes_k, ref_k) and same_bits(planes_v, ref_v)


def cos_sin_then_rope(positions, inv_freq, q, k, neox):
    """In the interpreter's worker: rope_cos_sin's tables, and rope_qk run on them as the
    decoder passes them (views into one buffer)."""
    from kernels.fused_rope import rope_cos_sin

    cos, sin = rope_cos_sin(positions, inv_freq)
    return cos.clone(), sin.clone(), *rope_qk(q, k, cos, sin, neox)


@pytest.mark.parametrize("tokens,dim,base,factors", [
    (1, 128, 500000.0, True), (37, 64, 10000.0, False), (5, 96, 1000000.0, False)])
def test_cos_sin_kernel_matches_float64(interp, gen, tokens, dim, base, factors):
    """rope_cos_sin: cos and sin of the float32 angle pos * inv_freq (as torch rounds it)
    within 2 ulp of float64's (cosf / sinf's bound in CUDA's math library; the interpreter
    takes numpy's), up to 128K positions and Llama 3's frequency factors; and the same
    float32 angle as the reference takes, so within 3 ulp of its tables. An approximate
    cos of the large angles, or an angle rounded otherwise, is off by orders more."""
    ff = torch.rand(dim // 2, generator=gen) * 7 + 1 if factors else None
    rope = Rope(dim, base, False, freq_factors=ff)
    # a column of a staged (rows, 3) block, as the decode graphs hold positions
    positions = torch.randint(0, 131072, (tokens, 3), generator=gen)[:, 1]
    positions[0] = 131071
    q = torch.randn(tokens, 4, dim, generator=gen)
    k = torch.randn(tokens, 2, dim, generator=gen)
    cos, sin, got_q, got_k = interp.call("test_fused_rope:cos_sin_then_rope", positions,
                                         rope.inv_freq, q, k, False)
    angle = (positions.to(torch.float32)[:, None] * rope.inv_freq).double()
    assert cos.shape == sin.shape == (tokens, 1, dim // 2)
    for got, want in ((cos, angle.cos()), (sin, angle.sin())):
        assert torch.isfinite(got).all(), "table not fully written"
        assert ((got[:, 0].double() - want).abs() <= 2.4e-7).all()
    ref_cos, ref_sin = rope_cos_sin_reference(positions, rope.inv_freq)
    assert ((cos - ref_cos).abs() <= 3.6e-7).all() and ((sin - ref_sin).abs() <= 3.6e-7).all()
    assert_close32(got_q, expected(rope, q, cos, sin, None))
    assert_close32(got_k, expected(rope, k, cos, sin, None))


def test_cos_sin_rejects_bad_inputs(interp):
    with pytest.raises(InvalidRequest, match="rope_cos_sin"):
        interp.call("kernels.fused_rope:rope_cos_sin", torch.zeros(3), torch.ones(8))
    with pytest.raises(InvalidRequest, match="rope_cos_sin"):
        interp.call("kernels.fused_rope:rope_cos_sin", torch.zeros(3, dtype=torch.long),
                    torch.ones(8, dtype=torch.float64))


@pytest.mark.gpu
def test_gpu_cos_sin_against_torch_cuda():
    """On the GPU: rope_cos_sin's tables against torch's CUDA ops on the same positions
    (within 2 ulp; the same math library, so expected equal) and float64."""
    if not torch.cuda.is_available():
        pytest.fail("marked gpu: run on a GPU machine with pytest -m gpu")
    from kernels.fused_rope import rope_cos_sin

    rope = Rope(128, 500000.0, False, freq_factors=torch.linspace(1, 8, 64))
    positions = torch.arange(0, 131072, 7, device="cuda")
    inv = rope.inv_freq.cuda()
    got = rope_cos_sin(positions, inv)
    want = rope_cos_sin_reference(positions, inv)
    angle = (positions.to(torch.float32)[:, None] * inv).double()
    for g, w, f in zip(got, want, (angle.cos(), angle.sin()), strict=True):
        assert (g - w).abs().max() <= 2.4e-7
        assert (g[:, 0].double() - f).abs().max() <= 2.4e-7
    print("equal to torch's", [bool(torch.equal(g, w)) for g, w in zip(got, want, strict=True)])
