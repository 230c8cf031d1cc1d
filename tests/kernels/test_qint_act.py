"""qint_act (kernels/qint.py, MBUFO_ACT_TAIL): a one-row fused gate|up product whose
programs also write the gated activation and its quantization, a block of 256 columns by
the last of the block's programs, against the product alone and kernels/gated_act.py's
kernel on its output (the same bits: both compute the same float32 expressions), on the
three finishing paths: splits in one program (Q4_K), tiles finished by a ticket's last
program (Q6_K), no split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_qint import stored
from test_qmatmul import random_weight

from kernels.gated_act import ACTIVATION_IDS
from kernels.qint import act_tail_enabled, default_qint_config, qint_act


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def act_both_ways(x, blocks, kind, k, activation, out_dtype, sms):
    """In the interpreter's worker: qint_act's (y, act, quantized act), and the product
    with the activation kernel after it."""
    from kernels.gated_act import gated_act_quant
    from kernels.qint import _act_tickets, qint_triton

    y, tail = qint_act(x, blocks, kind, k, xq=None, act=ACTIVATION_IDS[activation],
                       out_dtype=out_dtype, num_sms=sms)
    plain = qint_triton(x, blocks, kind, (blocks.shape[0], k), num_sms=sms)
    out, xq = gated_act_quant(plain, activation, out_dtype)
    return y, tail, plain, out, xq, int(_act_tickets(x.device).abs().sum())


@pytest.mark.parametrize("qtype,sms,path", [(T.Q4_K, 132, "in_cta"), (T.Q6_K, 132, "ticket"),
                                             (T.Q4_K, 0, "one split")])
@pytest.mark.parametrize("activation,out_dtype", [("silu", torch.float32),
                                                  ("gelu", torch.bfloat16)])
def test_act_tail_gives_the_activation_kernels_bits(interp, rng, qtype, sms, path, activation,
                                                    out_dtype):
    ffn, k = 512, 512
    blocks, kind = stored(random_weight(qtype, 2 * ffn, k, rng), qtype, k)
    cfg = default_qint_config(kind, 2 * ffn, k, sms)
    assert {"in_cta": cfg.in_cta and cfg.split > 1, "ticket": not cfg.in_cta and cfg.split > 1,
            "one split": cfg.split == 1}[path], cfg
    x = torch.from_numpy(rng.standard_normal((1, k), dtype=np.float32))
    for _ in range(2):  # the counters are left zero: a second launch finishes too
        y, tail, plain, out, xq, left = interp.call("test_qint_act:act_both_ways", x, blocks,
                                                    kind, k, activation, out_dtype, sms)
        assert torch.equal(y, plain)
        assert tail.out.dtype == out_dtype and torch.equal(tail.out, out)
        for got, want in zip(tail.xq, xq, strict=True):
            assert torch.equal(got, want)
        assert left == 0


def test_where_one_launch_cannot(rng):
    """More than one row, or F not a multiple of 256: None (the caller runs both
    kernels)."""
    k = 256
    q4 = random_weight(T.Q4_K, 1024, k, rng)
    assert qint_act(torch.zeros(2, k), q4, int(T.Q4_K), k, xq=None, act=0) is None
    odd = random_weight(T.Q4_K, 768, k, rng)  # F = 384
    assert qint_act(torch.zeros(1, k), odd, int(T.Q4_K), k, xq=None, act=0) is None


@pytest.mark.parametrize("raw,want", [(None, False), ("", False), ("0", False), ("1", True)])
def test_setting(monkeypatch, raw, want):
    if raw is None:
        monkeypatch.delenv("MBUFO_ACT_TAIL", raising=False)
    else:
        monkeypatch.setenv("MBUFO_ACT_TAIL", raw)
    assert act_tail_enabled() is want


def test_bad_setting_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("MBUFO_ACT_TAIL", "2")
    with pytest.raises(ValueError, match="MBUFO_ACT_TAIL must be 0 or 1"):
        act_tail_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_gpu_act_tail_at_llama_shape(rng, out_dtype):
    """Llama-3.1-8B's gate|up (Q4_K 28672 x 4096) at one row: ten launches in a row give
    the product's and the activation kernel's bits, and leave the counters zero."""
    from kernels.gated_act import gated_act_quant
    from kernels.qint import _act_tickets, qint_triton

    dev, ffn, k = torch.device("cuda"), 14336, 4096
    blocks = random_weight(T.Q4_K, 2 * ffn, k, rng).to(dev)
    x = torch.from_numpy(rng.standard_normal((1, k), dtype=np.float32)).to(dev)
    plain = qint_triton(x, blocks, int(T.Q4_K), (2 * ffn, k))
    out, xq = gated_act_quant(plain, "silu", out_dtype)
    for _ in range(10):
        y, tail = qint_act(x, blocks, int(T.Q4_K), k, xq=None, act=0, out_dtype=out_dtype)
        assert torch.equal(y, plain) and torch.equal(tail.out, out)
        for got, want in zip(tail.xq, xq, strict=True):
            assert torch.equal(got, want)
    assert int(_act_tickets(dev).abs().sum()) == 0
