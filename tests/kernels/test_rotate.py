"""kernels/rotate.py's launch (interpreted on the CPU) bit for bit against rotate_exact, on
fresh random rows of odd shapes, strided views and bf16 inputs; a row's bits alone and
among other rows; rotate_exact against the float64 Hadamard matrix."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequest
from engine.kv.hadamard import hadamard_matrix
from kernels.rotate import rotate, rotate_exact


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 4, 64), (5, 3, 32), (37, 1, 128),
                                              (2, 32, 128)])
def test_the_launch_gives_rotate_exacts_bits(interp, gen, tokens, heads, dim):
    x = torch.randn(tokens, heads, dim, generator=gen)
    x[..., 3] *= 50  # an outlier channel
    got = interp.call("kernels.rotate:rotate", x)
    assert got.dtype == torch.float32 and got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got, rotate_exact(x))
    first = interp.call("kernels.rotate:rotate", x[:1])  # alone: the same bits
    assert torch.equal(first[0], got[0])


def test_strided_and_bf16_inputs(interp, gen):
    """q as a view of a qkv row (token stride past the heads), and a bf16 tensor."""
    qkv = torch.randn(6, 3 * 64 + 40, generator=gen)
    q = qkv[:, :3 * 64].view(6, 3, 64)
    assert torch.equal(interp.call("kernels.rotate:rotate", q), rotate_exact(q))
    heads_apart = torch.randn(6, 3, 96, generator=gen)[:, :, :64]
    assert torch.equal(interp.call("kernels.rotate:rotate", heads_apart),
                       rotate_exact(heads_apart))
    b = torch.randn(4, 2, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(interp.call("kernels.rotate:rotate", b), rotate_exact(b.float()))


def test_rotate_exact_is_the_hadamard_product(gen):
    """Against x @ H in float64 (H_32 / sqrt(32), Sylvester): within float32's rounding;
    H is its own inverse."""
    x = torch.randn(9, 2, 96, generator=gen, dtype=torch.float64)
    want = (x.reshape(9, 2, 3, 32) @ hadamard_matrix(32, torch.float64)).reshape(x.shape)
    got = rotate_exact(x)
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 2**-23 * want.abs() + 1e-30).all()
    back = rotate_exact(got.double()).double()
    torch.testing.assert_close(back, x, rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_refused():
    with pytest.raises(InvalidRequest, match="multiple of 32"):
        rotate(torch.zeros(2, 3, 40))
    with pytest.raises(InvalidRequest, match="multiple of 32"):
        rotate(torch.zeros(2, 64))
