"""Rows of a GGML block tensor decoded to float32 in one launch: the token embedding on the
GPU path, which then keeps the table in its blocks (Llama 3 8B's Q4_K table: 295 MB,
against 1.05 GB held dense in bf16) and looks up exact values (a bf16 table rounds them).

Q8_0, Q4_K and Q6_K, the embedding types of llama.cpp's quantization mixes, with gguf-py's
float32 operations in its order (`gguf.quants`): Q8_0 d * q; Q4_K (d * sc) * q - dmin * m,
two roundings and no fused multiply-add (the launch turns fusion off); Q6_K (d * sc) * q.
So a row is bit-equal to `gguf.quants.dequantize`'s. The ids are not checked here (a
request's tokens are, at admission: engine/core.py); an id past the table reads its last
row rather than memory past it.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from engine.errors import InvalidRequest
from kernels.dequant import block_geometry
from kernels.triton_util import HAS_TRITON, await_inputs, helper, jit, launcher, tl

__all__ = ["GATHER_TYPES", "can_gather", "gather_rows"]

GATHER_TYPES = frozenset({int(T.Q8_0), int(T.Q4_K), int(T.Q6_K)})
_SPAN = 256  # elements a program decodes


def can_gather(ggml_type: int, cols: int) -> bool:
    """Whether gather_rows takes rows of `cols` columns of `ggml_type` (with Triton)."""
    return HAS_TRITON and int(ggml_type) in GATHER_TYPES and cols % _SPAN == 0


if HAS_TRITON:

    @helper
    def _f16_at(p):
        """The float16 at byte pointer p (2-byte aligned) as float32."""
        return tl.load(p.to(tl.pointer_type(tl.uint16), bitcast=True)).to(
            tl.float16, bitcast=True).to(tl.float32)

    @jit
    def _gather_kernel(raw_ptr, ids_ptr, out_ptr, rows, row_bytes, cols, stride_ids,
                       QTYPE: tl.constexpr, PDL: tl.constexpr = False):
        """Elements [256 j, 256 (j + 1)) (program 1) of the row of id t (program 0; ids
        t * stride_ids apart: the decode graphs stage them as a column)."""
        t = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        e = tl.arange(0, 256)
        await_inputs(PDL)
        row = tl.load(ids_ptr + t * stride_ids)
        row = tl.minimum(tl.maximum(row, 0), rows - 1).to(tl.int64)
        if QTYPE == 8:  # Q8_0: 8 blocks of d (f16) and 32 int8 codes
            blk = raw_ptr + row * row_bytes + (j * 8 + e // 32).to(tl.int64) * 34
            d = _f16_at(blk)
            q = tl.load((blk + 2 + e % 32).to(tl.pointer_type(tl.int8), bitcast=True))
            v = d * q.to(tl.float32)
        elif QTYPE == 12:  # Q4_K: d, dmin (f16), scales[12], 128 code bytes
            blk = raw_ptr + row * row_bytes + j.to(tl.int64) * 144
            s = e // 32  # sub-block: low nibbles of bytes 32 g + l for 2 g, high for 2 g + 1
            lo = s < 4
            a = tl.load(blk + 4 + tl.where(lo, s, s + 4)).to(tl.int32)  # scales[j] / [j + 4]
            b = tl.load(blk + 4 + tl.where(lo, s + 4, s - 4)).to(tl.int32)
            c = tl.load(blk + 4 + s).to(tl.int32)  # scales[j]: the high min's top bits
            sc = tl.where(lo, a & 63, (a & 15) | ((b >> 6) << 4))
            mn = tl.where(lo, b & 63, (a >> 4) | ((c >> 6) << 4))
            code = tl.load(blk + 16 + 32 * (s // 2) + e % 32).to(tl.int32)
            q = tl.where(s % 2 == 0, code & 15, code >> 4).to(tl.float32)
            scale = _f16_at(blk) * sc.to(tl.float32)
            low = _f16_at(blk + 2) * mn.to(tl.float32)
            v = scale * q - low
        else:  # Q6_K: ql[128], qh[64], scales[16] (int8), d (f16)
            blk = raw_ptr + row * row_bytes + j.to(tl.int64) * 210
            h = e // 128
            r = e % 128
            ql = tl.load(blk + 64 * h + r % 64).to(tl.int32)
            ql = tl.where(r < 64, ql & 15, ql >> 4)
            qh = (tl.load(blk + 128 + 32 * h + r % 32).to(tl.int32) >> (2 * (r // 32))) & 3
            sc = tl.load((blk + 192 + e // 16).to(tl.pointer_type(tl.int8), bitcast=True))
            v = (_f16_at(blk + 208) * sc.to(tl.float32)) * ((ql | (qh << 4)) - 32).to(tl.float32)
        col = j * 256 + e
        tl.store(out_ptr + t * cols + col, v, mask=col < cols)


def gather_rows(raw: torch.Tensor, ggml_type: int, cols: int,
                ids: torch.Tensor) -> torch.Tensor:
    """raw (rows, row_bytes) uint8 blocks of a (rows, cols) GGML_TYPES tensor, ids (T,)
    integers on its device (any stride) -> (T, cols) float32, one launch on a GPU (or the
    CPU when the interpreter is active). No host synchronisation (graph capture)."""
    qtype = int(ggml_type)
    if qtype not in GATHER_TYPES or not HAS_TRITON:
        raise InvalidRequest(f"gather_rows: no kernel for GGML type {qtype}")
    block, size = block_geometry(qtype)
    if raw.dim() != 2 or raw.dtype != torch.uint8 or cols % _SPAN or \
            raw.shape[1] != cols // block * size or not raw.is_contiguous():
        raise InvalidRequest(f"gather_rows: raw must be contiguous uint8 (rows, "
                             f"{cols // block * size}) blocks of {cols} columns, got "
                             f"{raw.dtype} {tuple(raw.shape)}")
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.device != raw.device:
        raise InvalidRequest("gather_rows: ids must be (T,) integers on the blocks' device")
    out = torch.empty(ids.shape[0], cols, dtype=torch.float32, device=raw.device)
    if ids.shape[0]:
        launcher(_gather_kernel, raw.device)[(ids.shape[0], cols // _SPAN)](
            raw, ids, out, raw.shape[0], raw.shape[1], cols, ids.stride(0), QTYPE=qtype,
            num_warps=2,
            **({} if raw.device.type == "cpu" else {"enable_fp_fusion": False}))
    return out


def aot_specs(spec: type) -> list:
    """kernels/aot.py: each type."""
    if not HAS_TRITON:
        return []
    sig = {"raw_ptr": "*u8", "ids_ptr": "*i64", "out_ptr": "*fp32", "rows": "i32",
           "row_bytes": "i32", "cols": "i32", "stride_ids": "i32", "QTYPE": "constexpr"}
    return [spec(f"gather_rows_{T(q).name}", _gather_kernel, sig, {"QTYPE": q}, 2, False)
            for q in GATHER_TYPES]
