"""kernels/gather_rows.py (interpreted on the CPU, output poisoned with NaN by the worker)
against gguf-py's dequantize of the same blocks: bit-equal rows, in the ids' order, with
repeats; and its input checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from test_qmatmul import random_weight

from engine.errors import InvalidRequest

KERNEL = "kernels.gather_rows:gather_rows"


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_rows_bit_equal_to_gguf(interp, rng, qtype):
    rows, cols = 37, 768
    blocks = random_weight(qtype, rows, cols, rng)
    # a column of a staged (rows, 3) block, as the decode graphs hold the token ids
    ids = torch.tensor([[5, 1, 2], [0, 3, 4], [36, 9, 9], [5, 0, 0], [17, 8, 8]])[:, 0]
    got = interp.call(KERNEL, blocks, int(qtype), cols, ids)
    want = torch.from_numpy(gguf_dequantize(blocks[ids].numpy(), qtype).reshape(len(ids), cols))
    assert got.dtype == torch.float32 and got.shape == (len(ids), cols)
    assert torch.isfinite(got).all(), "output not fully written"
    assert torch.equal(got, want)


def test_an_id_past_the_table_reads_its_last_row(interp, rng):
    blocks = random_weight(T.Q4_K, 3, 256, rng)
    got = interp.call(KERNEL, blocks, int(T.Q4_K), 256, torch.tensor([7, -1]))
    want = torch.from_numpy(gguf_dequantize(blocks.numpy(), T.Q4_K).reshape(3, 256))
    assert torch.equal(got[0], want[2]) and torch.equal(got[1], want[0])


def test_checks_inputs(interp, rng):
    blocks = random_weight(T.Q4_K, 3, 256, rng)
    ids = torch.tensor([0])
    with pytest.raises(InvalidRequest, match="no kernel"):
        interp.call(KERNEL, blocks, int(T.Q5_K), 256, ids)
    with pytest.raises(InvalidRequest, match="raw must be"):
        interp.call(KERNEL, blocks[:, :100], int(T.Q4_K), 256, ids)
    with pytest.raises(InvalidRequest, match="ids must be"):
        interp.call(KERNEL, blocks, int(T.Q4_K), 256, ids.float())


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_gpu_rows_bit_equal_to_gguf(rng, qtype):
    """On the GPU (the launch turns multiply-add fusion off: Q4_K's two roundings)."""
    if not torch.cuda.is_available():
        pytest.fail("marked gpu: run on a GPU machine with pytest -m gpu")
    from kernels.gather_rows import gather_rows

    rows, cols = 1000, 4096
    blocks = random_weight(qtype, rows, cols, rng)
    ids = torch.from_numpy(rng.integers(0, rows, (64, 3)))[:, 1]
    got = gather_rows(blocks.cuda(), int(qtype), cols, ids.cuda()).cpu()
    want = torch.from_numpy(gguf_dequantize(blocks[ids].numpy(), qtype).reshape(64, cols))
    assert torch.equal(got, want)


def embed_both_ways(raw: torch.Tensor, qtype: int, shape: tuple, ids: torch.Tensor):
    """In the worker: the Embedding of raw blocks on the Triton path (gather_rows) and on
    the torch one (dequantize_rows)."""
    from engine.kernel_select import set_mode
    from engine.layers.embedding import Embedding

    emb = Embedding(None, raw.reshape(-1), qtype, shape)
    try:
        set_mode("triton")
        fast = emb(ids)
        set_mode("torch")
        return fast, emb(ids)
    finally:
        set_mode(None)


def test_embedding_takes_the_kernel_with_the_same_bits(interp, rng):
    blocks = random_weight(T.Q6_K, 50, 512, rng)
    ids = torch.tensor([3, 49, 3, 0])
    fast, plain = interp.call("test_gather_rows:embed_both_ways", blocks, int(T.Q6_K),
                              (50, 512), ids)
    assert torch.equal(fast, plain) and fast.shape == (4, 512)
