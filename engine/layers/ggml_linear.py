"""A linear layer that keeps its weight in the file's GGML blocks (the GPU layout).

The blocks of a (out, in) weight are a uint8 (out, row_bytes) tensor on the device and
each call runs kernels/qmatmul.py's fused dequant-matmul (the Triton kernel on a GPU, its
reference elsewhere, or when MBUFO_KERNELS=torch). Rows of one GGML type concatenate
block-row-wise, so a fused q/k/v or gate/up of one type is one launch; parts of other
types (Q4_K_M files keep attn_v and ffn_down in Q6_K) are separate launches whose outputs
are concatenated. Float matrices (F32, F16, BF16: gpt-oss's attention and output, F16
files) are held in bf16 and run the same kernels as a BF16 "block" type, so their rows are
batch-invariant too (a vendor matrix library picks its kernel, and with it the order of
the sums, by the row count); with a float32 `dense_dtype` (exact parity runs) they stay
float32 and go through torch.matmul. With `act8` (the `q8` layout) Q4_K and Q6_K parts
multiply x quantized to 8 bits instead (kernels/qint.py: its own numerics, batch-invariant
as well); their Q6_K blocks are repacked at load into qint's aligned rows (Q6_K_A).

The `hybrid` layout (engine/models/weights.py) keeps a bf16 copy of the whole matrix
beside the blocks (`dense`): a call of `dense_rows` rows or more multiplies the copy (one
torch matmul: the matrix units at full rate, where the block kernels fall behind at many
rows), fewer rows the blocks. A row's result then depends on how many rows share its call,
so that layout is not batch-invariant across its threshold (the block layouts are: a
row's bits never depend on what shares its call).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch

from engine.errors import GGUFFormatError
from engine.kernel_select import use_triton
from kernels.dequant import block_geometry, dequantize
from kernels.qint import (
    ACT8_STORED,
    QINT_TYPES,
    qint_parts,
    qint_reference,
    qint_triton,
    repack_q6k,
)
from kernels.qmatmul import SUPPORTED_TYPES, qmatmul, qmatmul_reference
from kernels.qtiles import BF16, FLOAT_TYPES
from kernels.quant_x import QuantX, quantize_x
from kernels.triton_util import thread_flag

# The GGML types that the q8 layout (act8) multiplies with 8-bit activations: Q4_K and
# Q6_K, the types of Q4_K_M and Q6_K files (their kernels beat the bf16-operand ones at
# 1-4 rows: bench/RESULTS.md, 2026-11-30).
ACT8_TYPES = frozenset(ACT8_STORED)

__all__ = ["GGMLLinear", "GGMLPart", "blocks_only"]

_LOCAL = threading.local()  # .blocks_only: dense copies set aside on this thread


def blocks_only() -> AbstractContextManager[None]:
    """Within it every call on this thread takes the blocks, dense copies or not (the
    warm-up: a hybrid model's steps then build the kernels of every row class, as the q8
    layout's do; engine/runner.py)."""
    return thread_flag(_LOCAL, "blocks_only")


class GGMLPart(NamedTuple):
    """Consecutive output rows held one way."""

    out_features: int
    ggml_type: int | None  # None: `weight` is a dense (out, in) matrix; else a GGML type or
    # kernels.qint.Q6_K_A
    weight: torch.Tensor  # uint8 (out, row_bytes) blocks, or dense (out, in) bf16/f32


class GGMLLinear:
    """y = x @ W.T (+ b); the call contract of engine/layers/linear.py's Linear."""

    def __init__(self, parts: Sequence[GGMLPart], in_features: int,
                 bias: torch.Tensor | None = None, *, act8: bool = False,
                 dense: torch.Tensor | None = None, dense_rows: int | None = None) -> None:
        if not parts:
            raise ValueError("GGMLLinear needs at least one part")
        if (dense is None) != (dense_rows is None) or (dense_rows is not None
                                                       and dense_rows < 1):
            raise ValueError("a dense copy needs its row threshold (>= 1), and only then")
        self.act8 = bool(act8)
        self.dense, self.dense_rows = dense, dense_rows
        if dense is not None:
            probe_out_dtype(dense.device)
        self.parts = tuple(parts)
        self.in_features = int(in_features)
        self.out_features = sum(p.out_features for p in self.parts)
        self.bias = None if bias is None else bias.float()
        if dense is not None and tuple(dense.shape) != (self.out_features, self.in_features):
            raise ValueError(f"dense copy {tuple(dense.shape)} is not the layer's "
                             f"{(self.out_features, self.in_features)}")
        qint = [self.act8 and p.ggml_type in QINT_TYPES for p in self.parts]
        # whether a call uses x quantized to 8 bits (kernels.quant_x.QuantX), which a caller
        # may hand over already made (the norm kernel before it); all parts: one qint call
        self.takes_xq, self._all_qint = any(qint), all(qint)

    @classmethod
    def from_raw(cls, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int],
                 bias: torch.Tensor | None = None, *, name: str = "tensor",
                 dense_dtype: torch.dtype = torch.bfloat16, act8: bool = False,
                 dense_rows: int | None = None) -> GGMLLinear:
        """raw: the tensor's GGUF bytes (flat uint8, on the target device); `dense_rows`:
        also keep a `dense_dtype` copy for calls of that many rows or more."""
        out_features, in_features = (int(s) for s in shape)
        if int(ggml_type) in FLOAT_TYPES and dense_dtype == torch.bfloat16:
            return cls._from_float(raw, ggml_type, shape, bias, name=name, act8=act8,
                                   dense_rows=dense_rows)
        if int(ggml_type) in SUPPORTED_TYPES:
            block, type_size = block_geometry(ggml_type)
            if in_features % block or raw.numel() != out_features * (in_features // block) * \
                    type_size:
                raise GGUFFormatError(f"{name}: {raw.numel()} bytes do not hold GGML type "
                                      f"{ggml_type} of shape {tuple(shape)}")
            blocks = raw.reshape(out_features, in_features // block * type_size).contiguous()
            stored = ACT8_STORED.get(int(ggml_type), int(ggml_type)) if act8 else int(ggml_type)
            if stored != int(ggml_type):  # Q6_K: qint's aligned rows
                blocks = repack_q6k(blocks, in_features)
            part = GGMLPart(out_features, stored, blocks)
            dense = None if dense_rows is None else dequantize(
                raw, ggml_type, shape, out_dtype=dense_dtype, name=name)
        else:
            part = GGMLPart(out_features, None,
                            dequantize(raw, ggml_type, shape, out_dtype=dense_dtype, name=name))
            dense = None if dense_rows is None else part.weight  # the same tensor, no copy
        return cls([part], in_features, bias, act8=act8, dense=dense, dense_rows=dense_rows)

    @classmethod
    def _from_float(cls, raw: torch.Tensor, ggml_type: int, shape: tuple[int, int],
                    bias: torch.Tensor | None, *, name: str, act8: bool,
                    dense_rows: int | None) -> GGMLLinear:
        """An F32/F16/BF16 matrix held in bf16 (F32 and F16 rounded once: the matrix unit
        multiplies in bf16 anyway) as a BF16 part of the block kernels, so its rows are
        batch-invariant like the blocks'; a BF16 file's bytes are used as they are, and a
        hybrid layer's dense copy is the same tensor."""
        out_features, in_features = (int(s) for s in shape)
        if int(ggml_type) == BF16:
            if raw.numel() != out_features * in_features * 2:
                raise GGUFFormatError(f"{name}: {raw.numel()} bytes do not hold BF16 of "
                                      f"shape {tuple(shape)}")
            weight = raw.reshape(out_features, in_features * 2).contiguous()
        else:
            weight = dequantize(raw, ggml_type, shape, out_dtype=torch.bfloat16,
                                name=name).view(torch.uint8)
        dense = None if dense_rows is None else weight.view(torch.bfloat16)
        return cls([GGMLPart(out_features, BF16, weight)], in_features, bias, act8=act8,
                   dense=dense, dense_rows=dense_rows)

    @classmethod
    def fuse(cls, linears: Sequence[GGMLLinear]) -> GGMLLinear:
        """One layer whose rows are `linears`' rows in order (all with the same input);
        neighbouring parts of one GGML type merge into one block matrix (one launch)."""
        in_features = linears[0].in_features
        if any(lin.in_features != in_features for lin in linears):
            raise ValueError("fused linears must share in_features")
        if len({lin.act8 for lin in linears}) > 1:
            raise ValueError("fused linears must share act8")
        if len({lin.dense_rows for lin in linears}) > 1:
            raise ValueError("fused linears must share their dense copies' threshold")
        parts: list[GGMLPart] = []
        for part in (p for lin in linears for p in lin.parts):
            last = parts[-1] if parts else None
            if last is not None and last.ggml_type == part.ggml_type and \
                    last.weight.dtype == part.weight.dtype:
                parts[-1] = GGMLPart(last.out_features + part.out_features, part.ggml_type,
                                     torch.cat([last.weight, part.weight]))
            else:
                parts.append(part)
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat([lin.bias if lin.bias is not None else
                              torch.zeros(lin.out_features, device=lin.parts[0].weight.device)
                              for lin in linears])
        dense = None
        if linears[0].dense is not None:
            dense = torch.cat([lin.dense for lin in linears])
            parts = _share_dense_rows(parts, dense)
        return cls(parts, in_features, bias, act8=linears[0].act8, dense=dense,
                   dense_rows=linears[0].dense_rows)

    @property
    def device(self) -> torch.device:
        return self.parts[0].weight.device

    @property
    def nbytes(self) -> int:
        """Bytes held: the parts' weights and the dense copy, each range of memory once (a
        dense part of a hybrid layer is a view of its copy: _share_dense_rows)."""
        held = {(t.data_ptr(), t.numel() * t.element_size()) for t in
                (p.weight for p in self.parts)}
        if self.dense is not None:
            start, size = self.dense.data_ptr(), self.dense.numel() * self.dense.element_size()
            held = {(ptr, n) for ptr, n in held if not start <= ptr < start + size}
            held.add((start, size))
        return sum(n for _, n in held)

    def dense_at(self, rows: int) -> bool:
        """Whether a call of `rows` rows multiplies the dense copy (never in blocks_only)."""
        return self.dense_rows is not None and rows >= self.dense_rows and \
            not getattr(_LOCAL, "blocks_only", False)

    def wants_xq(self, rows: int) -> bool:
        """Whether a call of `rows` rows uses x quantized to 8 bits (which the kernel before
        it may make: engine/models/common.py)."""
        return self.takes_xq and not self.dense_at(rows)

    def input_dtype(self, rows: int) -> torch.dtype:
        """The dtype the call of `rows` rows multiplies x in (what the kernel before it best
        writes: no cast launch of its own)."""
        return self.dense.dtype if self.dense_at(rows) else torch.float32

    def __call__(self, x: torch.Tensor, xq: QuantX | None = None) -> torch.Tensor:
        """x (n, in) float32 -> (n, out) float32; `xq`: x quantized (kernels/qint.py), for
        the q8 parts on the Triton path (made here once for all of them when not given)."""
        if self.dense_at(x.shape[0]):
            y = dense_matmul(x, self.dense)
            return y if self.bias is None else y + self.bias
        if x.stride(-1) != 1:
            x = x.contiguous()
        triton = use_triton(x.device)
        if triton and self.takes_xq and xq is None:
            xq = quantize_x(x)
        if triton and self._all_qint:
            # all parts at once (q|k in Q4_K and v in Q6_K: one launch at decode)
            y = qint_parts(x, [(p.weight, p.ggml_type, p.out_features) for p in self.parts],
                           self.in_features, xq=xq)
            return y if self.bias is None else y + self.bias
        outs = [self._part(part, x, triton, xq) for part in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return y if self.bias is None else y + self.bias

    def _part(self, part: GGMLPart, x: torch.Tensor, triton: bool,
              xq: QuantX | None) -> torch.Tensor:
        if part.ggml_type is None:
            w = part.weight
            return torch.matmul(x.to(w.dtype), w.t()).float()
        shape = (part.out_features, self.in_features)
        if self.act8 and part.ggml_type in QINT_TYPES:
            if triton:
                return qint_triton(x, part.weight, part.ggml_type, shape, xq=xq)
            return qint_reference(x, part.weight, part.ggml_type, shape).float()
        if triton:
            return qmatmul(x, part.weight, part.ggml_type, shape)
        return qmatmul_reference(x, part.weight, part.ggml_type, shape).float()


_MM_OUT_DTYPE: dict[str, bool] = {}  # device type -> torch.mm(..., out_dtype=) works there


def probe_out_dtype(device: torch.device) -> bool:
    """Whether torch.mm on `device` writes float32 from bf16 operands itself (out_dtype);
    asked once per device type at load, never inside a graph capture."""
    kind = torch.device(device).type
    if kind not in _MM_OUT_DTYPE:
        ok = False
        if kind != "cpu":
            try:
                a = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
                ok = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
            except (RuntimeError, TypeError, NotImplementedError):
                ok = False
        _MM_OUT_DTYPE[kind] = ok
    return _MM_OUT_DTYPE[kind]


def _share_dense_rows(parts: list[GGMLPart], dense: torch.Tensor) -> list[GGMLPart]:
    """`parts` with each float part (BF16 bytes, or a dense f32 matrix) replaced by the
    view of its rows in the fused copy `dense`, whose rows are the same values (the part's
    own tensor was the unfused copy: held twice otherwise)."""
    out, row = [], 0
    for part in parts:
        rows = dense[row:row + part.out_features]
        if part.ggml_type == BF16 and dense.dtype == torch.bfloat16:
            part = part._replace(weight=rows.view(torch.uint8))
        elif part.ggml_type is None and part.weight.dtype == dense.dtype:
            part = part._replace(weight=rows)
        out.append(part)
        row += part.out_features
    return out


def dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (n, in) @ w (out, in).T in w's dtype -> float32 (n, out). Where probe_out_dtype
    found it, the product writes float32 itself: no cast launch after it."""
    x = x.to(w.dtype)
    if w.dtype != torch.float32 and _MM_OUT_DTYPE.get(x.device.type, False):
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return torch.matmul(x, w.t()).float()
