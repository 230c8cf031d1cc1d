"""kernels/qint_flow.py (the one-row gated MLP as one launch), interpreted on the CPU on one
program (the interpreter runs programs one after another: a program waiting for a later
one would never be released), against the three launches it replaces (kernels/qint.py's
gate|up product and kernels/gated_act.py's activation: the same bits) and gguf-py's
dequantize of down @ the quantized activation in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from test_qmatmul import random_weight

from engine.errors import InvalidRequest
from kernels.qint import Q6_K_A, QIntConfig, dequantized_x_reference, in_cta_config, repack_q6k
from kernels.qint_flow import DX_PAD, FlowConfig, check_shapes, counter_ints

H, F = 512, 2048
# 2 chunks, every gate|up item first; 4 chunks, each chunk's down items after the next
# chunk's gate|up items, gate|up in smaller tiles
CONFIGS = [FlowConfig(chunk_sb=4, gu_rows=32, gu_split=2, d_rows=16, d_split=2, lag=2),
           FlowConfig(chunk_sb=2, gu_rows=8, gu_split=2, d_rows=32, d_split=2, lag=1)]


def flow_case(x, gate_up, down, down_type, cfg, activation):
    """In the worker: the flow launch twice on the same counters, and the launches it
    replaces."""
    from kernels.gated_act import gated_act_quant
    from kernels.qint import Q4_K, qint_triton, quantize_x
    from kernels.qint_flow import mlp_flow

    xq = quantize_x(x)
    ctr = torch.zeros(counter_ints(F, H, cfg), dtype=torch.int32)
    y, gu, aq = mlp_flow(xq, gate_up, down, down_type, H, F, activation, 1, cfg, ctr)
    after_first = ctr.clone()
    y2, _, _ = mlp_flow(xq, gate_up, down, down_type, H, F, activation, 1, cfg, ctr)
    gu_want = qint_triton(x, gate_up, Q4_K, (2 * F, H),
                          in_cta_config(QIntConfig(cfg.gu_rows * cfg.gu_split,
                                                   cfg.gu_split, 2)), xq=xq)
    _, aq_want = gated_act_quant(gu_want, activation)
    return y, y2, gu, aq, gu_want, aq_want, after_first, ctr


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("down_qtype,activation,cfg", [(T.Q4_K, "silu", CONFIGS[0]),
                                                       (T.Q6_K, "gelu", CONFIGS[1])])
def test_flow_matches_the_launches_and_the_definition(interp, rng, down_qtype, activation,
                                                      cfg):
    gate_up = random_weight(T.Q4_K, 2 * F, H, rng)
    down_blocks = random_weight(down_qtype, H, F, rng)
    down, down_type = ((repack_q6k(down_blocks, F), Q6_K_A) if down_qtype == T.Q6_K
                       else (down_blocks, int(T.Q4_K)))
    x = torch.from_numpy(rng.standard_normal((1, H), dtype=np.float32))
    y, y2, gu, aq, gu_want, aq_want, after_first, ctr = interp.call(
        "test_qint_flow:flow_case", x, gate_up, down, down_type, cfg, activation)
    assert torch.equal(gu, gu_want)  # gate|up: the one-row launch's tile, its bits
    chunks = F // (256 * cfg.chunk_sb)
    assert torch.equal(aq.q, aq_want.q) and torch.equal(aq.bs, aq_want.bs)
    dx = aq.dx.reshape(chunks, DX_PAD)[:, :cfg.chunk_sb].reshape(1, -1)
    assert torch.equal(dx, aq_want.dx)
    # y against the definition: down dequantized by gguf-py, times the quantized activation
    w = torch.from_numpy(gguf_dequantize(down_blocks.numpy(), down_qtype).astype(np.float64))
    xa = aq_want.dx.double().repeat_interleave(256, dim=1) * aq_want.q.double()
    ref, bound = xa @ w.T, xa.abs() @ w.abs().T
    assert torch.isfinite(y).all(), "y not fully written"
    assert ((y.double() - ref).abs() <= 2**-16 * bound + 1e-30).all()
    # the counts reset themselves: a second launch on them gives the same y
    assert not after_first.any() and not ctr.any()
    assert torch.equal(y, y2)
    # and the product stays that of the float activation within the quantization's error
    act = dequantized_x_reference(torch.nn.functional.silu(gu_want[:, :F]) * gu_want[:, F:]
                                  if activation == "silu" else
                                  torch.nn.functional.gelu(gu_want[:, :F], approximate="tanh")
                                  * gu_want[:, F:])
    assert ((y.double() - act.double() @ w.T).abs() <= 2**-5 * (act.abs().double() @ w.abs().T)
            + 1e-6 * bound).all()


def test_shapes_checked():
    check_shapes(4096, 14336, FlowConfig())
    with pytest.raises(InvalidRequest, match="chunks of 2048"):
        check_shapes(4096, 14336 + 256, FlowConfig())
    with pytest.raises(InvalidRequest, match="super-blocks in 3"):
        check_shapes(4096, 14336, FlowConfig(d_split=3))
    assert counter_ints(14336, 4096, FlowConfig()) == 32 * (1 + 3 * 7) + 4096 // 16
