"""GGML block dequantization: the plain-torch reference and the dispatching entry points.

`raw` is the tensor's bytes exactly as stored in the GGUF file (a 1-D uint8 tensor, for
instance a view of the mmap); `shape` is in torch order, so the innermost dim is GGML's
ne0, the one blocks run along. The reference equals `gguf.quants.dequantize` bit for bit
in float32 (see `dequant_simple` for why), and other out dtypes are that float32 result
cast once. Work runs in chunks of blocks, so the temporaries stay a few MiB whatever the
tensor size: the output plus O(chunk) is all the memory a call needs.
"""

from __future__ import annotations

import math

import torch
from gguf import GGMLQuantizationType

from engine.errors import GGUFFormatError, InvalidRequest, UnsupportedTensorType
from kernels import dequant_kquants, dequant_simple
from kernels.dequant_simple import BlockFormat

__all__ = [
    "SUPPORTED_TYPES",
    "block_geometry",
    "dequantize",
    "dequantize_reference",
    "dequantize_rows",
]

_FORMATS: dict[int, BlockFormat] = {**dequant_simple.FORMATS, **dequant_kquants.FORMATS}
SUPPORTED_TYPES: frozenset[int] = frozenset(_FORMATS)

# Elements decoded per step. At 32K a step's largest temporary (an f32 or int64 copy of
# the chunk) stays at 128-256 KiB: cache-resident, and in glibc's heap rather than a fresh
# mmap per step (at 64K the page faults made Q8_0 9x slower); the per-step Python overhead
# (~10-25 torch ops) is still small.
_CHUNK_ELEMENTS = 1 << 15
# On an accelerator the cost is per kernel launch, not cache misses: far larger steps.
_DEVICE_CHUNK_ELEMENTS = 1 << 22


def _type_name(ggml_type: int) -> str:
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _format(ggml_type: int) -> BlockFormat:
    fmt = _FORMATS.get(int(ggml_type))
    if fmt is None:
        raise UnsupportedTensorType(f"cannot dequantize GGML {_type_name(ggml_type)}")
    return fmt


def block_geometry(ggml_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported GGML type."""
    fmt = _format(ggml_type)
    return fmt.block_size, fmt.type_size


def _check(raw: torch.Tensor, ggml_type: int, shape: tuple[int, ...], name: str) -> BlockFormat:
    """Validate `raw` against `shape`; returns the block format."""
    fmt = _format(ggml_type)
    what = f"{name} ({_type_name(ggml_type)}, shape {tuple(shape)})"
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        got = f"{raw.dtype} {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw)
        raise GGUFFormatError(f"{what}: raw data must be a 1-D uint8 tensor, got {got}")
    if len(shape) == 0 or any(int(s) < 0 for s in shape):
        raise GGUFFormatError(f"{what}: shape must have at least one dim, none negative")
    if shape[-1] % fmt.block_size:
        raise GGUFFormatError(
            f"{what}: row length {shape[-1]} is not a multiple of the block size {fmt.block_size}"
        )
    expected = math.prod(shape[:-1]) * (shape[-1] // fmt.block_size) * fmt.type_size
    if raw.numel() != expected:
        raise GGUFFormatError(f"{what}: expected {expected} bytes, got {raw.numel()}")
    return fmt


def _check_dtype(out_dtype: torch.dtype) -> None:
    if not out_dtype.is_floating_point:
        raise InvalidRequest(f"dequantization needs a floating out_dtype, got {out_dtype}")


def _decode_into(blocks: torch.Tensor, fmt: BlockFormat, out: torch.Tensor) -> None:
    """Decode (num_blocks, type_size) u8 `blocks` into the flat `out` (num_blocks * block)."""
    chunk = _CHUNK_ELEMENTS if out.device.type == "cpu" else _DEVICE_CHUNK_ELEMENTS
    step = max(1, chunk // fmt.block_size)
    out_blocks = out.view(-1, fmt.block_size)
    for start in range(0, blocks.shape[0], step):
        stop = min(start + step, blocks.shape[0])
        out_blocks[start:stop].copy_(fmt.decode(blocks[start:stop]))


def dequantize_reference(
    raw: torch.Tensor,
    ggml_type: int,
    shape: tuple[int, ...],
    out_dtype: torch.dtype = torch.float32,
    *,
    name: str = "tensor",
) -> torch.Tensor:
    """GGUF bytes -> a new tensor of `shape` in `out_dtype`, on `raw`'s device.

    Raises UnsupportedTensorType for a type outside SUPPORTED_TYPES and GGUFFormatError
    (naming `name`) when the byte count or the row length does not fit the type.
    """
    fmt = _check(raw, ggml_type, tuple(shape), name)
    _check_dtype(out_dtype)
    out = torch.empty(math.prod(shape), dtype=out_dtype, device=raw.device)
    if out.numel():
        _decode_into(raw.contiguous().view(-1, fmt.type_size), fmt, out)
    return out.view(tuple(shape))


def dequantize_rows(
    raw: torch.Tensor,
    ggml_type: int,
    shape: tuple[int, ...],
    row_ids: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    *,
    name: str = "tensor",
) -> torch.Tensor:
    """Rows `row_ids` of the 2-D tensor (rows, cols) -> (*row_ids.shape, cols) in out_dtype.

    Equal to `dequantize(raw, ggml_type, shape)[row_ids]` without building the table (the
    embedding lookup). Out-of-range or non-integer ids raise InvalidRequest.
    """
    if len(shape) != 2:
        raise GGUFFormatError(f"{name}: dequantize_rows needs a 2-D shape, got {tuple(shape)}")
    fmt = _check(raw, ggml_type, tuple(shape), name)
    _check_dtype(out_dtype)
    num_rows, num_cols = (int(s) for s in shape)
    if row_ids.dtype.is_floating_point or row_ids.dtype.is_complex or row_ids.dtype == torch.bool:
        raise InvalidRequest(f"{name}: row ids must be integers, got {row_ids.dtype}")
    ids = row_ids.reshape(-1).to(device=raw.device, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
        raise InvalidRequest(
            f"{name}: row ids must lie in [0, {num_rows}), got {int(ids.min())}..{int(ids.max())}"
        )
    # (num_ids, row_bytes): only the selected rows' bytes are gathered.
    row_bytes = raw.contiguous().view(num_rows, -1 if num_rows else 0).index_select(0, ids)
    out = torch.empty(ids.numel() * num_cols, dtype=out_dtype, device=raw.device)
    if out.numel():
        _decode_into(row_bytes.view(-1, fmt.type_size), fmt, out)
    return out.view(*row_ids.shape, num_cols)


def dequantize(
    raw: torch.Tensor,
    ggml_type: int,
    shape: tuple[int, ...],
    out_dtype: torch.dtype = torch.float32,
    *,
    name: str = "tensor",
) -> torch.Tensor:
    """The entry point the engine calls; today every device runs the reference."""
    return dequantize_reference(raw, ggml_type, shape, out_dtype, name=name)
