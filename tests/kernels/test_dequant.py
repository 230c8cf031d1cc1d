"""Parity of kernels.dequant against gguf-py's `gguf.quants.dequantize` (the independent
implementation), bit for bit in float32, on random blocks of every supported type."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from engine.errors import GGUFFormatError, InvalidRequest, UnsupportedTensorType
from kernels.dequant import (
    SUPPORTED_TYPES,
    block_geometry,
    dequantize,
    dequantize_reference,
    dequantize_rows,
)

# Byte offsets of the f16 scale fields in each block (the block_* structs of ggml-common.h).
# Random bytes there could be inf/NaN; they are overwritten with finite random halves.
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.MXFP4: (),
}
ALL_TYPES = sorted(T(t) for t in SUPPORTED_TYPES)
# Odd row counts, a 1-D and a 3-D tensor, and one (130, 512) larger than a decode chunk.
SHAPES = [(1, 256), (5, 512), (123, 256), (256,), (2, 3, 256), (130, 512)]


def random_bytes(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """GGUF bytes of a random tensor of `shape` whose dequantized values are all finite."""
    rng = np.random.default_rng([seed, int(qtype), *shape])
    numel = math.prod(shape)
    if qtype == T.F32:
        return rng.standard_normal(numel).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.standard_normal(numel).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        bits = rng.standard_normal(numel).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (numel // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.standard_normal((blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    if qtype == T.MXFP4:
        # e8m0 exponent: 2**(e-128) * 12 overflows for e > 252; keep 0 and 1 (subnormals).
        blocks[:, 0] = rng.integers(0, 253, blocks.shape[0], dtype=np.uint8)
        blocks[:2, 0] = (0, 1)
    return blocks.reshape(-1)


def gguf_reference(raw: np.ndarray, qtype: T, shape: tuple[int, ...]) -> np.ndarray:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = shape[-1] // block_size * type_size
    out = gguf_dequantize(raw.reshape(*shape[:-1], row_bytes), qtype)
    assert out.dtype == np.float32 and out.shape == shape
    return out


def assert_bit_equal(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    got_bits = got.numpy().view(np.uint32)
    want_bits = want.view(np.uint32)
    mismatch = np.flatnonzero(got_bits != want_bits)
    assert mismatch.size == 0, (
        f"{mismatch.size} of {want.size} differ, first at {mismatch[0]}: "
        f"{got.numpy().reshape(-1)[mismatch[0]]} vs {want.reshape(-1)[mismatch[0]]}"
    )


def test_supported_types_and_geometry_match_gguf():
    names = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
             "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"}
    assert {T(t).name for t in SUPPORTED_TYPES} == names
    for qtype in SUPPORTED_TYPES:
        assert block_geometry(qtype) == GGML_QUANT_SIZES[T(qtype)]
    with pytest.raises(UnsupportedTensorType):
        block_geometry(T.IQ2_XXS)
    with pytest.raises(UnsupportedTensorType):
        block_geometry(999)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matches_gguf_bit_for_bit(qtype: T, shape: tuple[int, ...]):
    raw = random_bytes(qtype, shape)
    want = gguf_reference(raw, qtype, shape)
    assert np.isfinite(want).all() and np.unique(want).size > 16  # a meaningful sample
    assert_bit_equal(dequantize_reference(torch.from_numpy(raw), qtype, shape), want)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_misaligned_bytes(qtype: T):
    # A tensor's bytes at an odd offset in a larger buffer (no aligned f16/f32 views).
    shape = (3, 512)
    raw = random_bytes(qtype, shape)
    buffer = torch.zeros(raw.size + 1, dtype=torch.uint8)
    buffer[1:] = torch.from_numpy(raw)
    got = dequantize(buffer[1:], qtype, shape)
    assert_bit_equal(got, gguf_reference(raw, qtype, shape))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_out_dtype_is_float32_result_cast(qtype: T, out_dtype: torch.dtype):
    shape = (7, 512)
    raw = random_bytes(qtype, shape, seed=1)
    want = torch.from_numpy(gguf_reference(raw, qtype, shape)).to(out_dtype)
    got = dequantize(torch.from_numpy(raw), qtype, shape, out_dtype)
    assert got.dtype == out_dtype
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("qtype", [T.F16, T.Q8_0, T.Q4_K, T.Q6_K, T.MXFP4], ids=lambda t: t.name)
def test_rows_equal_slicing(qtype: T):
    shape = (37, 512)
    raw = torch.from_numpy(random_bytes(qtype, shape, seed=2))
    full = torch.from_numpy(gguf_reference(raw.numpy(), qtype, shape))
    row_ids = torch.tensor([[36, 0, 5], [5, 17, 1]])  # repeats, any order, a 2-D id batch
    got = dequantize_rows(raw, qtype, shape, row_ids)
    assert got.shape == (2, 3, 512)
    assert torch.equal(got.view(torch.int32), full[row_ids].view(torch.int32))
    got_bf16 = dequantize_rows(raw, qtype, shape, torch.tensor([3, 30]), torch.bfloat16)
    assert torch.equal(got_bf16, full[[3, 30]].to(torch.bfloat16))
    assert dequantize_rows(raw, qtype, shape, torch.tensor([], dtype=torch.long)).shape == (0, 512)


def test_rows_rejects_bad_ids():
    shape = (4, 32)
    raw = torch.from_numpy(random_bytes(T.Q8_0, shape))
    for bad in (torch.tensor([4]), torch.tensor([-1]), torch.tensor([0.0])):
        with pytest.raises(InvalidRequest):
            dequantize_rows(raw, T.Q8_0, shape, bad)
    with pytest.raises(GGUFFormatError):
        dequantize_rows(raw, T.Q8_0, (2, 2, 32), torch.tensor([0]))


@pytest.mark.parametrize("qtype", [T.F32, T.BF16, T.Q4_0, T.Q3_K, T.MXFP4], ids=lambda t: t.name)
def test_wrong_sizes_raise(qtype: T):
    block_size, _ = GGML_QUANT_SIZES[qtype]
    shape = (3, 256)
    raw = torch.from_numpy(random_bytes(qtype, shape))
    for wrong in (raw[:-1], torch.cat([raw, raw[:1]])):
        with pytest.raises(GGUFFormatError, match="bytes"):
            dequantize_reference(wrong, qtype, shape, name="blk.0.attn_q.weight")
    with pytest.raises(GGUFFormatError, match="blk.0"):
        dequantize_reference(raw[:-1], qtype, shape, name="blk.0.attn_q.weight")
    with pytest.raises(GGUFFormatError):
        dequantize_reference(raw.view(3, -1), qtype, shape)  # not 1-D
    with pytest.raises(GGUFFormatError):
        dequantize_reference(raw.to(torch.int16), qtype, shape)  # not uint8
    if block_size > 1:
        with pytest.raises(GGUFFormatError, match="multiple"):
            dequantize_reference(raw, qtype, (3 * 256 // block_size, block_size + 1))


def test_unsupported_type_and_dtype_raise():
    raw = torch.zeros(34, dtype=torch.uint8)
    with pytest.raises(UnsupportedTensorType, match="Q8_1"):
        dequantize(raw, T.Q8_1, (32,))
    with pytest.raises(InvalidRequest):
        dequantize(raw, T.Q8_0, (32,), torch.int32)


def test_empty_tensor():
    out = dequantize(torch.zeros(0, dtype=torch.uint8), T.Q4_K, (0, 256), torch.bfloat16)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16
