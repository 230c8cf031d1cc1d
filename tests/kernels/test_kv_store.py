"""kv_store's kernel (interpreted on the CPU) bit for bit against its torch reference, for
every format pair, on fresh random K/V (an outlier channel in K, K and V of different head
dims, read as strided views of a qkv row) stored at random distinct slots of planes that
start out filled with random bytes (so a missed or stray write shows). The reference is
checked against engine/kv/formats.py's encoders: bit-equal for f16 and the unrotated
formats, and its exact rotation against the float64 Hadamard matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequest
from engine.kv.formats import FORMATS
from engine.kv.hadamard import hadamard_matrix
from kernels.kv_store import kv_encode_reference, kv_store, kv_store_reference, rotate_exact

PAIRS = [("f16", "f16"), ("q8", "q8"), ("q8", "q4"), ("q4", "q8"), ("q4", "q4"),
         ("q8_plain", "q4_plain")]


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def store(k, v, slots, k_planes, v_planes, k_format, v_format):
    """kv_store in the worker, returning the planes it wrote into (called by name). The
    worker's tensors arrive through shared memory, so the caller's planes change too."""
    kv_store(k, v, slots, k_planes, v_planes, k_format, v_format)
    return k_planes, v_planes


def clone(planes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: p.clone() for n, p in planes.items()}


def random_planes(gen, fmt: str, slots: int, heads: int, dim: int) -> dict[str, torch.Tensor]:
    planes = FORMATS[fmt].allocate(slots, heads, dim, "cpu")
    for p in planes.values():  # random bytes (f16 bit patterns of NaN included)
        raw = torch.randint(0, 256, (p.numel() * p.element_size(),), dtype=torch.uint8,
                            generator=gen)
        p.view(-1).view(torch.uint8).copy_(raw)
    return planes


def case(gen, tokens: int, heads: int, dk: int, dv: int):
    qkv = torch.randn(tokens, heads * (dk + dv) + 5, generator=gen)
    k = qkv[:, :heads * dk].reshape(tokens, heads, dk)
    k[..., 3] *= 20  # an outlier channel, as real K has
    k[0, 0, :32] = 0.0  # an all-zero block (zero scale)
    # Blocks whose plain codes are exact ties (scale 1: amax 127 for q8, m = -8 for q4),
    # which round half to even; the q4 block's largest magnitude comes twice, with both
    # signs (the first one is m).
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5] * 4)
    k[-1, 0, 32:64] = torch.cat([torch.tensor([127.0]), ties[1:]])
    k[-1, 1, :32] = torch.cat([torch.tensor([-8.0]), ties[1:9], torch.tensor([8.0]), ties[10:]])
    v = qkv[:, heads * dk:heads * (dk + dv)].reshape(tokens, heads, dv) * 0.3
    slots = torch.randperm(3 * tokens, generator=gen)[:tokens]
    return k, v, slots


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8))
        for n in a)


@pytest.mark.parametrize("k_format,v_format", PAIRS)
@pytest.mark.parametrize("tokens,heads", [(1, 2), (13, 3)])
def test_kernel_bit_equal_to_reference(interp, gen, k_format, v_format, tokens, heads):
    dk, dv = 64, 96
    k, v, slots = case(gen, tokens, heads, dk, dv)
    k_planes = random_planes(gen, k_format, 3 * tokens, heads, dk)
    v_planes = random_planes(gen, v_format, 3 * tokens, heads, dv)
    ref_k, ref_v = clone(k_planes), clone(v_planes)
    got_k, got_v = interp.call("test_kv_store:store", k, v, slots, k_planes, v_planes,
                               k_format, v_format)
    kv_store_reference(k, v, slots, ref_k, ref_v, k_format, v_format)
    assert same_bits(got_k, ref_k) and same_bits(got_v, ref_v)


@pytest.mark.parametrize("fmt", ["f16", "q8_plain", "q4_plain"])
def test_reference_is_the_formats_encoder(gen, fmt):
    k, _, _ = case(gen, 9, 2, 64, 32)
    assert same_bits(kv_encode_reference(k, fmt), FORMATS[fmt].encode(k))


def test_rotate_exact_is_hadamard_rounded_once(gen):
    x = torch.randn(50, 4, 64, generator=gen) * torch.logspace(-3, 3, 64)
    got = rotate_exact(x).double()
    want = (x.double().reshape(-1, 32) @ hadamard_matrix(32, torch.float64)).reshape(x.shape)
    ulp = torch.abs(torch.nextafter(got.float(), torch.tensor(np.inf)).double() - got)
    assert ((got - want).abs() <= 0.5001 * ulp).all()


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_rotated_reference_close_to_formats_encoder(gen, fmt):
    """formats.py rotates with a float32 matmul: its codes may differ by rounding (rarely),
    its decoded values as little as the quantizer's own error."""
    k, _, _ = case(gen, 40, 2, 128, 32)
    ours, theirs = kv_encode_reference(k, fmt), FORMATS[fmt].encode(k)
    assert (ours["codes"] == theirs["codes"]).float().mean() > 0.99
    dec_ours, dec_theirs = FORMATS[fmt].decode(ours), FORMATS[fmt].decode(theirs)
    err = (dec_ours - k).norm() / k.norm()
    assert err < (0.01 if fmt == "q8" else 0.1), float(err)
    assert (dec_ours - dec_theirs).norm() / k.norm() < 0.1 * err + 1e-6


def test_wrapper_rejects_bad_inputs(interp, gen):
    k, v, slots = case(gen, 3, 2, 64, 64)
    planes = FORMATS["q8"].allocate(8, 2, 64, "cpu")
    with pytest.raises(InvalidRequest):  # wrong plane shape for V's head dim
        interp.call("test_kv_store:store", k, v[..., :32], slots, planes, planes, "q8", "q8")
    with pytest.raises(InvalidRequest):
        interp.call("test_kv_store:store", k, v, slots, planes, planes, "q8", "q5")
    with pytest.raises(InvalidRequest):
        interp.call("test_kv_store:store", k.double(), v, slots, planes, planes, "q8", "q8")


def test_cpu_without_interpreter_runs_the_reference(gen):
    k, v, slots = case(gen, 5, 2, 64, 64)
    a = [random_planes(gen, "q4", 15, 2, 64) for _ in range(2)]
    b = [clone(planes) for planes in a]
    kv_store(k, v, slots, *a, "q4", "q4")
    kv_store_reference(k, v, slots, *b, "q4", "q4")
    assert same_bits(a[0], b[0]) and same_bits(a[1], b[1])


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_cpu_formats_encode_like_the_kernel_reference(fmt):
    """The CPU path's encode (engine/kv/formats.py) rounds the rotation as the GPU kernel
    does, so both write the same codes: bit-equal planes, outlier channels included."""
    from engine.kv.formats import FORMATS

    g = torch.Generator().manual_seed(7)
    x = torch.randn(8000, 2, 128, generator=g) * torch.logspace(-2, 2, 128)  # 2M values:
    # a float32 matmul rotation rounds differently on about 1 in 200K (scales and codes)
    x[:, :, 5] *= 50
    want = kv_encode_reference(x, fmt)
    got = FORMATS[fmt].encode(x)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
