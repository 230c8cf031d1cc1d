"""The CPU int8 layout: distance from exact float64 math, and row results independent of
the batch they share (both kernels: FBGEMM's integer GEMM and torch's weight-only one)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import linear
from engine.layers.linear import Int8Linear, quantize_rows_int8

KERNELS = [pytest.param(True, id="fbgemm"), pytest.param(False, id="int8pack")]


def _layer(out: int, k: int, fbgemm: bool, seed: int = 0, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g) * torch.rand(out, 1, generator=g)
    codes, scales = quantize_rows_int8(w)
    b = torch.randn(out, generator=g) if bias else None
    dense = codes.double() * scales.double()[:, None]
    return Int8Linear(codes, scales, b, fbgemm=fbgemm), dense, b


def _inputs(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, n)[:, None]
    x[:, :3] *= 20  # outlier channels, as real hidden states have
    return x


@pytest.fixture(autouse=True)
def _need_fbgemm(request):
    if "fbgemm" in request.node.name and not linear.USE_FBGEMM:
        pytest.fail("FBGEMM's dynamic quantized linear is missing from this torch build")


@pytest.mark.parametrize("fbgemm", KERNELS)
@pytest.mark.parametrize("shape", [(64, 32), (300, 640), (17, 2048)])
def test_close_to_exact_math(fbgemm: bool, shape: tuple[int, int]):
    out, k = shape
    layer, dense, b = _layer(out, k, fbgemm, bias=True)
    x = _inputs(9, k, seed=1)
    want = x.double() @ dense.T + b.double()
    got = layer(x).double()
    # per row, relative to the size of the products: ~13-bit activations (FBGEMM) or bf16
    bound = (x.double().abs() @ dense.abs().T).amax(1, keepdim=True)
    tol = 2e-4 if fbgemm else 8e-3
    assert ((got - want).abs() <= tol * bound + 1e-6).all(), float(
        ((got - want).abs() / bound).max())


@pytest.mark.parametrize("fbgemm", KERNELS)
def test_rows_bit_equal_whatever_shares_the_batch(fbgemm: bool):
    layer, _, _ = _layer(257, 640, fbgemm, bias=True)
    x = _inputs(64, 640, seed=2)
    x[5] = 0.0  # an all-zero row
    x[6] *= 1e6
    alone = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    for rows in ([slice(0, 64)], [slice(0, 3), slice(3, 40), slice(40, 64)]):
        got = torch.cat([layer(x[r]) for r in rows])
        assert torch.equal(got, alone)
    others = _inputs(200, 640, seed=3) * 1e3
    mixed = layer(torch.cat([others[:100], x, others[100:]]))[100:164]
    assert torch.equal(mixed, alone)
    assert torch.equal(alone[5], layer.bias)


def test_fbgemm_closer_to_exact_than_bf16_activations():
    """Two code rows (~13 bits of the row's largest magnitude) against bf16 activations
    (8-bit mantissa): the reason the residual row exists."""
    fb, dense, _ = _layer(128, 640, True)
    plain, _, _ = _layer(128, 640, False)
    x = _inputs(16, 640, seed=4)
    want = x.double() @ dense.T
    bound = (x.double().abs() @ dense.abs().T).amax(1, keepdim=True)

    def err(layer: Int8Linear) -> float:
        return float(((layer(x).double() - want).abs() / bound).max())

    assert err(fb) < err(plain) / 4, (err(fb), err(plain))
