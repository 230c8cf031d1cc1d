"""gated_act's kernel (interpreted on the CPU, outputs poisoned with NaN by the worker) and
its torch reference against float64 SwiGLU and tanh-GeGLU written here from the formulas,
on fresh random rows (odd counts, widths that are not a multiple of the block, row-strided
inputs, gate values far into both tails)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequest
from kernels.gated_act import gated_act, gated_act_quant, gated_act_reference
from kernels.quant_x import quantize_x_reference

KERNEL = "kernels.gated_act:gated_act"


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def operands(gate_up: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 (g, u) the activation multiplies: gpt-oss's clamped and shifted."""
    g, u = gate_up.double().chunk(2, dim=-1)
    if activation == "swiglu_oai":  # ggml_swiglu_oai: alpha 1.702, limit 7
        return torch.minimum(g, torch.tensor(7.0)), u.clamp(-7.0, 7.0) + 1
    return g, u


def expected(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    g, u = operands(gate_up, activation)
    if activation == "silu":
        return g / (1 + torch.exp(-g)) * u
    if activation == "swiglu_oai":
        return g / (1 + torch.exp(-1.702 * g)) * u
    return 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u


def case(gen, rows: int, ffn: int, strided: bool) -> torch.Tensor:
    gu = torch.randn(rows, 2 * ffn + (3 if strided else 0), generator=gen) * 4
    gu[:, :ffn:7] *= 25  # tails: e^-g overflows, tanh saturates
    return gu[:, :2 * ffn] if strided else gu


def assert_close32(got: torch.Tensor, gate_up: torch.Tensor, activation: str,
                   rel: float = 4e-6) -> None:
    """A few ulp of the result (or its bf16 rounding: `rel`), plus a few ulp of |g u|:
    1 + tanh(z) cancels for negative g in float32 (in torch as in the kernel)."""
    assert torch.isfinite(got).all(), "output not fully written"
    want = expected(gate_up, activation)
    g, u = operands(gate_up, activation)
    err = (got.double() - want).abs()
    tol = rel * want.abs() + 4e-7 * (g * u).abs() + 1e-30
    assert (err <= tol).all(), float((err / tol).max())


@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
@pytest.mark.parametrize("rows,ffn,strided", [(1, 96, False), (7, 1500, True), (3, 2048, False)])
def test_kernel_matches_float64(interp, gen, activation, rows, ffn, strided):
    gu = case(gen, rows, ffn, strided)
    assert_close32(interp.call(KERNEL, gu, activation), gu, activation)


@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
def test_kernel_bf16_output(interp, gen, activation):
    gu = case(gen, 3, 200, True)
    got = interp.call(KERNEL, gu, activation, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert_close32(got, gu, activation, rel=2.0**-8 + 4e-6)


@pytest.mark.parametrize("activation", ["silu", "gelu", "swiglu_oai"])
def test_reference_matches_float64(gen, activation):
    gu = case(gen, 5, 300, False)
    assert_close32(gated_act_reference(gu, activation), gu, activation)


@pytest.mark.parametrize("rows,ffn,strided", [(2, 1280, True), (3, 256, False)])
def test_quant_variant_writes_qint_codes(interp, gen, rows, ffn, strided):
    """gated_act_quant: the same output, and it quantized with kernels/qint.py's bits
    (1280 columns: the second 1024-column program holds one super-block)."""
    gu = case(gen, rows, ffn, strided)
    out, xq = interp.call("kernels.gated_act:gated_act_quant", gu, "silu")
    assert torch.equal(out, interp.call(KERNEL, gu, "silu"))
    q, dx, bs = interp.call("kernels.qint:quantize_x", out)
    assert torch.equal(xq.q, q) and torch.equal(xq.dx, dx) and torch.equal(xq.bs, bs)
    assert torch.equal(q.int(), quantize_x_reference(out)[0])
    ref, ref_q = gated_act_quant(gu, "silu")  # no interpreter here: the reference
    assert torch.equal(ref_q.q.int(), quantize_x_reference(ref)[0])
    with pytest.raises(InvalidRequest, match="256"):
        interp.call("kernels.gated_act:gated_act_quant", gu[:, :200], "silu")


def test_wrapper_rejects_bad_inputs(interp, gen):
    gu = case(gen, 3, 64, False)
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, gu, "relu")
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, gu[:, :127], "silu")
    with pytest.raises(InvalidRequest):
        interp.call(KERNEL, gu.double(), "silu")


def test_cpu_without_interpreter_runs_the_reference(gen):
    gu = case(gen, 3, 64, False)
    assert torch.equal(gated_act(gu, "gelu"), gated_act_reference(gu, "gelu"))
