"""qint_norm (kernels/qint.py, MBUFO_NORM_TAIL): a one-row product whose last program also
adds y to the residual stream and normalizes it, against the product alone and torch's
F.rms_norm (kernels/fused_norm.py's reference), on the three finishing paths: splits in
one program (Q4_K), tiles finished by a ticket's last program (Q6_K), no split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_qint import stored
from test_qmatmul import random_weight

from engine.errors import InvalidRequest
from kernels.fused_norm import add_rms_norm_reference
from kernels.qint import (
    default_qint_config,
    norm_tail_enabled,
    norm_tail_setting,
    qint_norm,
    quant_x_reference,
)


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("qtype,sms,path,slots", [
    (T.Q4_K, 132, "in_cta", False), (T.Q4_K, 132, "in_cta", True),
    (T.Q6_K, 132, "ticket", False), (T.Q6_K, 132, "ticket", True),  # slots: no effect
    (T.Q4_K, 0, "one split", False)])
@pytest.mark.parametrize("out_dtype,quantize", [(torch.float32, True),
                                                (torch.bfloat16, False)])
def test_norm_tail_matches_the_product_and_the_norm(interp, rng, qtype, sms, path, slots,
                                                    out_dtype, quantize):
    n, k = 768, 512
    blocks, kind = stored(random_weight(qtype, n, k, rng), qtype, k)
    cfg = default_qint_config(kind, n, k, sms)
    assert {"in_cta": cfg.in_cta and cfg.split > 1, "ticket": not cfg.in_cta and cfg.split > 1,
            "one split": cfg.split == 1}[path], cfg
    x = torch.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
    residual = torch.from_numpy(rng.standard_normal((1, n), dtype=np.float32)) * 4
    weight = torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float32))
    for _ in range(2):  # the counter is left zero: a second launch finishes too
        y, tail = interp.call("kernels.qint:qint_norm", x, blocks, kind, k, xq=None,
                              residual=residual, weight=weight, eps=1e-5,
                              out_dtype=out_dtype, quantize=quantize, num_sms=sms,
                              slots=slots)
        plain = interp.call("kernels.qint:qint_triton", x, blocks, kind, (n, k), num_sms=sms)
        assert torch.equal(y, plain)  # the product's bits are unchanged
        assert torch.equal(tail.h, residual + y)
        ref = add_rms_norm_reference(residual, weight, 1e-5, y, None, torch.float64)
        assert tail.out.dtype == out_dtype
        tol = 2**-20 if out_dtype == torch.float32 else 2**-8
        assert torch.allclose(tail.out.double(), ref.y, rtol=tol, atol=tol * 1e-3)
        if quantize:  # the codes of the written output, as quantize_x makes them
            want = quant_x_reference(tail.out)
            for got, exp in zip(tail.xq, want, strict=True):
                assert torch.equal(got, exp.to(got.dtype))
        else:
            assert tail.xq is None
    assert int(interp.call("kernels.qint:_norm_ticket", torch.device("cpu"))[0]) == 0


def test_where_one_launch_cannot(rng):
    """More than one row, or N not a multiple of 256: None (the caller runs both kernels);
    a residual or weight of the wrong shape: a clear error."""
    k = 256
    blocks = random_weight(T.Q4_K, 512, k, rng)
    w = torch.ones(512)
    assert qint_norm(torch.zeros(2, k), blocks, int(T.Q4_K), k, xq=None,
                     residual=torch.zeros(2, 512), weight=w, eps=1e-5) is None
    small = random_weight(T.Q4_K, 200, k, rng)
    assert qint_norm(torch.zeros(1, k), small, int(T.Q4_K), k, xq=None,
                     residual=torch.zeros(1, 200), weight=torch.ones(200), eps=1e-5) is None
    with pytest.raises(InvalidRequest, match="qint_norm: weight must be contiguous float32"):
        qint_norm(torch.zeros(1, k), blocks, int(T.Q4_K), k, xq=None,
                  residual=torch.zeros(1, 512), weight=torch.ones(512, dtype=torch.float16),
                  eps=1e-5)


@pytest.mark.parametrize("raw,want", [(None, 0), ("", 0), ("0", 0), ("1", 1), (" 2 ", 2)])
def test_setting(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("MBUFO_NORM_TAIL", raising=False)
    else:
        monkeypatch.setenv("MBUFO_NORM_TAIL", raw)
    assert norm_tail_setting() == want and norm_tail_enabled() is (want > 0)


@pytest.mark.parametrize("raw", ["yes", "3", "on"])
def test_bad_setting_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv("MBUFO_NORM_TAIL", raw)
    with pytest.raises(ValueError, match="MBUFO_NORM_TAIL must be 0, 1 or 2"):
        norm_tail_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [False, True])
@pytest.mark.parametrize("qtype,n,k", [(T.Q4_K, 4096, 4096), (T.Q4_K, 4096, 14336),
                                       (T.Q6_K, 4096, 14336)])
def test_gpu_norm_tail_at_llama_shapes(rng, qtype, n, k, slots):
    """The o and down products of Llama-3.1-8B at one row (Q4_K: splits in one program;
    Q6_K: tickets) with the norm's tail, against the product alone and the norm kernel
    (kernels/fused_norm.py) on its output; ten launches in a row (the counter re-arms)."""
    from kernels.fused_norm import add_rms_norm
    from kernels.qint import qint_triton

    dev = torch.device("cuda")
    blocks, kind = stored(random_weight(qtype, n, k, rng), qtype, k)
    blocks = blocks.to(dev)
    x = torch.from_numpy(rng.standard_normal((1, k), dtype=np.float32)).to(dev)
    residual = torch.from_numpy(rng.standard_normal((1, n), dtype=np.float32)).to(dev) * 4
    weight = torch.from_numpy(rng.uniform(0.5, 1.5, n).astype(np.float32)).to(dev)
    plain = qint_triton(x, blocks, kind, (n, k))
    ref = add_rms_norm(residual, weight, 1e-5, plain, None, torch.bfloat16, True)
    for _ in range(10):
        y, tail = qint_norm(x, blocks, kind, k, xq=None, residual=residual, weight=weight,
                            eps=1e-5, out_dtype=torch.bfloat16, quantize=True,
                            slots=slots)
        assert torch.equal(y, plain)
        assert torch.equal(tail.h, ref.h)
        assert torch.allclose(tail.out.float(), ref.y.float(), rtol=2**-8, atol=0)
        codes = (tail.xq.q.int() - ref.xq.q.int()).abs()
        assert int(codes.max()) <= 1 and float((codes > 0).float().mean()) < 0.01
        want = quant_x_reference(tail.out.float().cpu())
        assert torch.equal(tail.xq.q.cpu(), want[0].to(torch.int8))
    from kernels.qint import _norm_ticket
    assert int(_norm_ticket(dev)[0]) == 0
