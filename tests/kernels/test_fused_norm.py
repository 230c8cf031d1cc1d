"""add_rms_norm's kernel (interpreted on the CPU, outputs poisoned with NaN by the worker)
and its torch reference against a float64 computation written here from the formula, on
fresh random rows of odd counts and widths, row-strided inputs included."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequest
from kernels.fused_norm import add_rms_norm, add_rms_norm_reference
from kernels.quant_x import quantize_x_reference

KERNEL = "kernels.fused_norm:add_rms_norm"
EPS = 1e-6


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def norm64(z: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    z = z.double()
    return z / torch.sqrt((z * z).mean(-1, keepdim=True) + EPS) * w.double()


def expected(x, w, residual, residual_weight) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.double()
    if residual is not None:
        h = h + (residual.double() if residual_weight is None else
                 norm64(residual, residual_weight))
    return h, norm64(h, w)


def assert_close32(got: torch.Tensor, want: torch.Tensor, rel: float = 0.0) -> None:
    """Float32 rounding of float64 values: a few ulp of the row's scale (plus `rel` of
    each value: a bf16 output's rounding)."""
    assert torch.isfinite(got).all(), "output not fully written"
    tol = 4e-6 * want.abs().amax(-1, keepdim=True) + rel * want.abs()
    err = (got.double() - want).abs()
    assert (err <= tol).all(), float((err / tol).max())


def case(gen, rows: int, dim: int, residual: bool, res_norm: bool, strided: bool):
    x = torch.randn(rows, dim + 7 if strided else dim, generator=gen) * 3
    x = x[:, :dim] if strided else x  # rows further apart than their width
    r = torch.randn(rows, dim, generator=gen) * 5 if residual else None
    w = torch.rand(dim, generator=gen) + 0.5
    rw = torch.rand(dim, generator=gen) + 0.5 if res_norm else None
    return x, w, r, rw


@pytest.mark.parametrize("rows,dim,residual,res_norm,strided", [
    (1, 64, False, False, False), (5, 96, True, False, True), (37, 100, True, True, False),
    (3, 1000, True, True, True), (2, 4096, True, False, False)])
def test_kernel_matches_float64(interp, gen, rows, dim, residual, res_norm, strided):
    x, w, r, rw = case(gen, rows, dim, residual, res_norm, strided)
    h, y, xq = interp.call(KERNEL, x, w, EPS, residual=r, residual_weight=rw)
    assert xq is None
    want_h, want_y = expected(x, w, r, rw)
    assert_close32(y, want_y)
    assert_close32(h, want_h)
    if r is None:
        assert torch.equal(h, x)  # no residual: the stream is x itself


@pytest.mark.parametrize("residual,res_norm", [(False, False), (True, False), (True, True)])
def test_reference_matches_float64(gen, residual, res_norm):
    x, w, r, rw = case(gen, 9, 200, residual, res_norm, False)
    h, y, _ = add_rms_norm_reference(x, w, EPS, r, rw)
    want_h, want_y = expected(x, w, r, rw)
    assert_close32(y, want_y)
    assert_close32(h, want_h)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_kernel_low_precision_output(interp, gen, out_dtype):
    """y rounded once to the matmul's input dtype (no cast kernel after the norm)."""
    x, w, r, rw = case(gen, 5, 300, True, False, True)
    h, y, _ = interp.call(KERNEL, x, w, EPS, residual=r, out_dtype=out_dtype)
    want_h, want_y = expected(x, w, r, None)
    assert y.dtype == out_dtype and h.dtype == torch.float32
    assert_close32(y, want_y, rel=2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-11)
    assert_close32(h, want_h)


def test_zero_rows(interp):
    x = torch.empty(0, 64)
    h, y, _ = interp.call(KERNEL, x, torch.ones(64), EPS, residual=torch.empty(0, 64))
    assert h.shape == y.shape == (0, 64)


def test_wrapper_rejects_bad_inputs(interp):
    x = torch.randn(3, 64)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, x, torch.ones(32), EPS)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, x.double(), torch.ones(64), EPS)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, x, torch.ones(64), EPS, residual=torch.randn(3, 63))
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, x, torch.ones(64), EPS, residual_weight=torch.ones(64))
    with pytest.raises(InvalidRequest, match="256"):
        interp.call(KERNEL, x, torch.ones(64), EPS, quantize=True)


@pytest.mark.parametrize("rows,dim,out_dtype", [(3, 256, torch.float32),
                                                (2, 768, torch.float32),
                                                (4, 512, torch.bfloat16)])
def test_kernel_quantizes_y_as_qint_does(interp, gen, rows, dim, out_dtype):
    """With `quantize` the kernel also writes y (as stored, in out_dtype) quantized for
    kernels/qint.py: the bits of its quantize_x kernel and of the definition; h and y
    unchanged. 768 columns: the row's block of 1024 holds a masked fourth super-block."""
    x, w, r, _ = case(gen, rows, dim, True, False, False)
    x[1, :256] = 0.0  # a zero super-block in y: dx = 0
    r[1, :256] = 0.0
    h, y, xq = interp.call(KERNEL, x, w, EPS, residual=r, out_dtype=out_dtype, quantize=True)
    h0, y0, none = interp.call(KERNEL, x, w, EPS, residual=r, out_dtype=out_dtype)
    assert none is None and torch.equal(h, h0) and torch.equal(y, y0)
    q, dx, bs = interp.call("kernels.qint:quantize_x", y)
    q_ref, dx_ref = quantize_x_reference(y)
    assert xq.q.dtype == torch.int8 and torch.equal(xq.q, q) and torch.equal(xq.q.int(), q_ref)
    assert torch.equal(xq.dx, dx) and torch.equal(xq.dx, dx_ref) and (dx_ref[1, 0] == 0)
    assert torch.equal(xq.bs, bs)
    ref = add_rms_norm_reference(x, w, EPS, r, out_dtype=out_dtype, quantize=True)
    assert torch.equal(ref.xq.q.int(), quantize_x_reference(ref.y)[0])


def test_cpu_without_interpreter_runs_the_reference(gen):
    x, w, r, rw = case(gen, 4, 64, True, True, False)
    got, ref = add_rms_norm(x, w, EPS, r, rw), add_rms_norm_reference(x, w, EPS, r, rw)
    assert torch.equal(got.h, ref.h) and torch.equal(got.y, ref.y)
