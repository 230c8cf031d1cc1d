"""Block decoders for the float types and the GGML types with 32-element blocks.

A decoder maps `(n, type_size)` uint8 blocks to `(n, block_size)` float32 values, in the
order llama.cpp's `dequantize_row_*` writes them (ggml/src/ggml-quants.c). The float32
arithmetic follows gguf-py's `quants.py` step by step (same operands, same order), so the
results are bit-equal to `gguf.quants.dequantize`: every intermediate is either an exact
integer or one rounded float32 product/sum, and torch's eager ops never fuse them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType as T

# IQ4_NL non-linear code book (kvalues_iq4nl in ggml-common.h).
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# E2M1 values times two (kvalues_mxfp4); the e8m0 scale is halved to compensate.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


class BlockFormat(NamedTuple):
    block_size: int  # elements per block
    type_size: int  # bytes per block
    decode: Callable[[torch.Tensor], torch.Tensor]  # (n, type_size) u8 -> (n, block_size) f32


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret the last dim of uint8 `x` as `dtype`; copies only when `x` is misaligned."""
    try:
        return x.view(dtype)
    except RuntimeError:  # storage offset or strides not a multiple of the new item size
        return x.contiguous().clone().view(dtype)


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """(n, type_size) u8 -> (n, 1) f32: the little-endian f16 at byte `offset` of each block."""
    return as_dtype(blocks[:, offset : offset + 2], torch.float16).float()


def split_bits(x: torch.Tensor, width: int) -> torch.Tensor:
    """(..., m) u8 -> (..., 8 // width, m) u8; [..., s, k] = field s (low bits first) of byte k."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=x.device).view(-1, 1)
    return (x.unsqueeze(-2) >> shifts) & ((1 << width) - 1)


def lookup(values: tuple[int, ...], codes: torch.Tensor) -> torch.Tensor:
    """u8 codes -> f32 code-book values of the same shape."""
    table = torch.tensor(values, dtype=torch.float32, device=codes.device)
    # index_select on a flat index is ~50x faster on CPU than advanced indexing table[codes].
    return table.index_select(0, codes.reshape(-1).long()).view(codes.shape)


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) u8 -> (n, 32) u8: element j is the low nibble of qs[j], element 16+j the high."""
    return split_bits(qs, 4).reshape(qs.shape[0], 32)


def _high_bits32(qh: torch.Tensor) -> torch.Tensor:
    """(n, 4) u8, a little-endian u32 -> (n, 32) u8: element j is bit j."""
    return split_bits(qh, 1).transpose(-1, -2).reshape(qh.shape[0], 32)


def _f32(b: torch.Tensor) -> torch.Tensor:
    return as_dtype(b, torch.float32)


def _f16(b: torch.Tensor) -> torch.Tensor:
    return as_dtype(b, torch.float16).float()


def _bf16(b: torch.Tensor) -> torch.Tensor:
    # bf16 -> f32 is a 16-bit shift, exact like gguf-py's int32 << 16.
    return as_dtype(b, torch.bfloat16).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # 18 bytes: d f16, qs[16]
    q = _nibbles32(b[:, 2:18]).float() - 8
    return f16_field(b, 0) * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # 20 bytes: d f16, m f16, qs[16]
    q = _nibbles32(b[:, 4:20]).float()
    return f16_field(b, 0) * q + f16_field(b, 2)


def _q5_0(b: torch.Tensor) -> torch.Tensor:  # 22 bytes: d f16, qh u32, qs[16]
    q = (_nibbles32(b[:, 6:22]) | (_high_bits32(b[:, 2:6]) << 4)).float() - 16
    return f16_field(b, 0) * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:  # 24 bytes: d f16, m f16, qh u32, qs[16]
    q = (_nibbles32(b[:, 8:24]) | (_high_bits32(b[:, 4:8]) << 4)).float()
    return f16_field(b, 0) * q + f16_field(b, 2)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # 34 bytes: d f16, qs int8[32]
    return b[:, 2:34].view(torch.int8).float() * f16_field(b, 0)


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:  # 18 bytes: d f16, qs[16] (code-book indices)
    return f16_field(b, 0) * lookup(IQ4NL_VALUES, _nibbles32(b[:, 2:18]))


def e8m0_half(e: torch.Tensor) -> torch.Tensor:
    """u8 e8m0 exponents -> f32 2**(e - 128) (ggml_e8m0_to_fp32_half); e < 2 are subnormals."""
    e = e.int()
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:  # 17 bytes: e u8, qs[16]
    return e8m0_half(b[:, 0:1]) * lookup(MXFP4_VALUES, _nibbles32(b[:, 1:17]))


FORMATS: dict[int, BlockFormat] = {
    T.F32: BlockFormat(1, 4, _f32),
    T.F16: BlockFormat(1, 2, _f16),
    T.BF16: BlockFormat(1, 2, _bf16),
    T.Q4_0: BlockFormat(32, 18, _q4_0),
    T.Q4_1: BlockFormat(32, 20, _q4_1),
    T.Q5_0: BlockFormat(32, 22, _q5_0),
    T.Q5_1: BlockFormat(32, 24, _q5_1),
    T.Q8_0: BlockFormat(32, 34, _q8_0),
    T.IQ4_NL: BlockFormat(32, 18, _iq4_nl),
    T.MXFP4: BlockFormat(32, 17, _mxfp4),
}
