"""Weight loading: GGUF tensors by name -> torch tensors, with shape checks.

On CPU the GGML blocks are dequantized at load into `dtype`: bf16, f32 (parity tests) or
int8 (per-row int8 codes, engine/layers/linear.py); norms and biases stay float32. The
embedding lookup reads the file's blocks directly when the table is not kept dense.
On a GPU the `ggml` layout keeps the linears' blocks (engine/layers/ggml_linear.py).
Fusions happen here, so the forward never sees the file layout.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch

from engine.errors import GGUFFormatError, InvalidRequest, UnsupportedTensorType
from engine.gguf import ModelFile
from engine.kernel_select import use_triton
from engine.layers.embedding import Embedding
from engine.layers.ggml_linear import GGMLLinear, GGMLPart
from engine.layers.linear import Int8Linear, Linear, quantize_rows_int8
from engine.layers.moe import DenseExperts, Experts, GroupedExperts
from kernels.dequant import dequantize
from kernels.gather_rows import can_gather
from kernels.moe import MOE_TYPES, row_bytes
from kernels.qtiles import BF16, F32, FLOAT_TYPES

FLOAT_TYPES_BY_DTYPE = {torch.float32: F32, torch.bfloat16: BF16}  # dense experts' GGML type


class MoEWeights(NamedTuple):
    """WeightLoader.experts: a MoE block's router, its bias or None, its gate|up parts (the
    outputs side by side are each expert's gate then up rows) and its down experts."""

    router: torch.Tensor
    router_bias: torch.Tensor | None
    gate_up: list[Experts]
    down: Experts

INT8_SLICE_ROWS = 8192  # rows dequantized at a time when re-quantizing to int8
# Linear weights: ggml (the file's blocks, fused dequant kernels), q8 (the blocks, with Q4_K
# products on 8-bit activations: kernels/qint.py), bf16 (dense in `dtype`), auto (ggml on
# a GPU with the Triton kernels unless dtype asks for exact f32, else dense), hybrid (q8's
# blocks, and a bf16 copy of each linear for calls of `dense_rows` rows or more).
LAYOUTS = ("auto", "ggml", "q8", "bf16", "hybrid")


def default_weight_dtype(device: torch.device) -> torch.dtype:
    """int8 on the CPU (half the bytes of bf16, batches well; its logits stay as close to
    exact f32 as llama.cpp's: bench/RESULTS.md), bf16 elsewhere."""
    return torch.int8 if device.type == "cpu" else torch.bfloat16


class WeightLoader:
    def __init__(self, model_file: ModelFile, dtype: torch.dtype | None = None,
                 device: torch.device | str = "cpu", layout: str = "auto",
                 dense_rows: int | None = None) -> None:
        self.file = model_file
        self.device = torch.device(device)
        self.dtype = dtype = default_weight_dtype(self.device) if dtype is None else dtype
        if dtype == torch.int8 and self.device.type != "cpu":
            raise InvalidRequest("the int8 weight layout runs on the CPU only")
        if layout not in LAYOUTS:
            raise InvalidRequest(f"weight layout {layout!r}: expected one of {LAYOUTS}")
        if (layout == "hybrid") != (dense_rows is not None):
            raise InvalidRequest("the hybrid weight layout takes its row threshold "
                                 "(dense_rows), and only it")
        if dense_rows is not None and dense_rows < 1:
            raise InvalidRequest(f"dense_rows must be at least 1, not {dense_rows}")
        if layout == "hybrid" and dtype.is_floating_point and dtype != torch.bfloat16:
            raise InvalidRequest(f"the hybrid weight layout's copies are bf16 (its threshold "
                                 f"and memory are measured so): dtype {dtype} is not")
        self.ggml = layout in ("ggml", "q8", "hybrid") or (
            layout == "auto" and self.device.type != "cpu" and dtype == torch.bfloat16
            and use_triton(self.device))
        self.act8 = layout in ("q8", "hybrid")
        self.dense_rows = dense_rows

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    @property
    def int8(self) -> bool:
        return self.dtype == torch.int8

    def raw(self, name: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
        """-> (the tensor's GGML bytes, flat uint8 on the loader's device, its ggml type)."""
        info = self.file.tensors.get(name)
        if info is None:
            raise GGUFFormatError(f"tensor '{name}' is missing")
        if tuple(info.shape) != tuple(shape):
            raise GGUFFormatError(
                f"tensor '{name}' has shape {tuple(info.shape)}, expected {tuple(shape)}")
        with warnings.catch_warnings():  # the mmap is read-only; nothing writes to `raw`
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.file.tensor_data(name)).reshape(-1)
        if self.device.type != "cpu":  # ship the blocks, dequantize on the device
            raw = raw.to(self.device, non_blocking=False)
        return raw, info.ggml_type

    def load(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        raw, ggml_type = self.raw(name, shape)
        return dequantize(raw, ggml_type, tuple(shape), out_dtype=dtype, name=name)

    def load_int8(self, name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (codes int8 (out, in), scales bf16 (out,)), re-quantized a slice of rows at a
        time so the float32 copy never exceeds INT8_SLICE_ROWS rows."""
        raw, ggml_type = self.raw(name, shape)
        rows, cols = shape
        by_row = raw.view(rows, -1) if rows else raw.view(0, 0)
        codes = torch.empty(shape, dtype=torch.int8)
        scales = torch.empty(rows, dtype=torch.bfloat16)
        for lo in range(0, rows, INT8_SLICE_ROWS):
            part = by_row[lo:lo + INT8_SLICE_ROWS]
            dense = dequantize(part.reshape(-1), ggml_type, (part.shape[0], cols), name=name)
            codes[lo:lo + part.shape[0]], scales[lo:lo + part.shape[0]] = quantize_rows_int8(
                dense)
        return codes, scales

    def vector(self, name: str, size: int) -> torch.Tensor:
        return self.load(name, (size,), torch.float32)

    def matrix(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        return self.load(name, shape, self.dtype)

    def embedding(self, name: str, shape: tuple[int, int]) -> Embedding:
        """The token table: dense in `dtype`, or read from the blocks per lookup: on the
        int8 layout, and on a GPU's block layouts where kernels/gather_rows.py decodes the
        type (a quarter of a bf16 table's bytes for Q4_K, exact values)."""
        info = self.file.tensors.get(name)
        gather = self.ggml and self.device.type != "cpu" and use_triton(self.device) and \
            info is not None and can_gather(info.ggml_type, shape[1])
        if self.int8 or gather:
            raw, ggml_type = self.raw(name, shape)
            return Embedding(None, raw, ggml_type, shape, name)
        return Embedding(self.matrix(name, shape))

    def head(self, name: str, shape: tuple[int, int], embedding: Embedding) -> Linear | Int8Linear:
        """The output projection `name`, or the tied token table when the file has none."""
        if self.has(name):
            return self._linear(name, shape, None)
        if embedding.table is not None and not self.ggml:  # ggml: the tied table's blocks
            return Linear(embedding.table)
        table = embedding.table
        if self.ggml and table is not None and table.dtype == torch.bfloat16 and \
                self.file.tensors[embedding.name].ggml_type in FLOAT_TYPES:
            # a float file's table is held in bf16 by both (ggml_linear.py): once
            return GGMLLinear([GGMLPart(shape[0], BF16, table.view(torch.uint8))], shape[1],
                              act8=self.act8, dense=None if self.dense_rows is None else table,
                              dense_rows=self.dense_rows)
        if self.ggml and embedding.raw is not None:  # the blocks the lookup reads, shared
            return self._ggml_linear(embedding.raw, int(embedding.ggml_type), embedding.name,
                                     shape, None)
        return self._linear(embedding.name, shape, None)

    def _ggml_linear(self, raw: torch.Tensor, ggml_type: int, name: str,
                     shape: tuple[int, int], bias: torch.Tensor | None) -> GGMLLinear:
        dense = self.dtype if self.dtype.is_floating_point else torch.bfloat16
        return GGMLLinear.from_raw(raw, ggml_type, shape, bias, name=name, dense_dtype=dense,
                                   act8=self.act8, dense_rows=self.dense_rows)

    def _linear(self, name: str, shape: tuple[int, int],
                bias: torch.Tensor | None) -> Linear | Int8Linear | GGMLLinear:
        if self.ggml:
            raw, ggml_type = self.raw(name, shape)
            return self._ggml_linear(raw, ggml_type, name, shape, bias)
        if self.int8:
            return Int8Linear(*self.load_int8(name, shape), bias)
        return Linear(self.matrix(name, shape), bias)

    def linear(self, prefix: str, shape: tuple[int, int]) -> Linear | Int8Linear:
        bias = None
        if self.has(prefix + ".bias"):
            bias = self.vector(prefix + ".bias", shape[0])
        return self._linear(prefix + ".weight", shape, bias)

    def fused(self, prefixes: list[str], out_sizes: list[int],
              in_size: int) -> Linear | Int8Linear:
        """Stack several linears with the same input into one (rows in `prefixes` order)."""
        if self.ggml:
            return GGMLLinear.fuse([self.linear(p, (o, in_size))
                                    for p, o in zip(prefixes, out_sizes, strict=True)])
        biases = [self.vector(p + ".bias", o) if self.has(p + ".bias") else None
                  for p, o in zip(prefixes, out_sizes, strict=True)]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(o, device=self.device)
                              for b, o in zip(biases, out_sizes, strict=True)])
        if self.int8:  # per-row scales stack with their rows
            loaded = [self.load_int8(p + ".weight", (o, in_size))
                      for p, o in zip(prefixes, out_sizes, strict=True)]
            return Int8Linear(torch.cat([c for c, _ in loaded]),
                              torch.cat([s for _, s in loaded]), bias)
        return Linear(torch.cat([self.matrix(p + ".weight", (o, in_size))
                                 for p, o in zip(prefixes, out_sizes, strict=True)]), bias)

    def experts(self, prefix: str, num_experts: int, ffn: int, hidden: int) -> MoEWeights:
        """A MoE block's router (`ffn_gate_inp`, float32, and its bias where the file has
        one) and its experts (`ffn_{gate,up,down}_exps`, and their biases where the file
        has them): their blocks on a GPU's block layouts (gate and up as one grouped
        product where they share a type), dense bf16 (f32) experts for the same grouped
        kernel on a GPU's dense layouts, one dense linear an expert on the CPU."""
        e = num_experts
        router = self.load(prefix + "ffn_gate_inp.weight", (e, hidden), torch.float32)
        router_bias = self._bias(prefix + "ffn_gate_inp.bias", (e,))
        gate, up, down = (prefix + f"ffn_{n}_exps.weight" for n in ("gate", "up", "down"))
        gb, ub = (self._bias(prefix + f"ffn_{n}_exps.bias", (e, ffn)) for n in ("gate", "up"))
        db = self._bias(prefix + "ffn_down_exps.bias", (e, hidden))
        gub = None if gb is None and ub is None else torch.cat(
            [b if b is not None else torch.zeros(e, ffn, device=self.device) for b in (gb, ub)],
            1)
        if self.ggml:
            parts = [self._experts(name, (e, ffn, hidden), b)
                     for name, b in ((gate, gb), (up, ub))]
            if parts[0].ggml_type == parts[1].ggml_type:
                parts = [GroupedExperts(torch.cat([p.blocks for p in parts], 1).contiguous(),
                                        parts[0].ggml_type, (2 * ffn, hidden), gub)]
            return MoEWeights(router, router_bias, parts, self._experts(down, (e, hidden, ffn),
                                                                        db))
        if use_triton(self.device):
            # the dense layouts on a GPU: the grouped kernel over dense experts (one launch
            # a product, captured in graphs), never a loop over the experts
            dense = self.dtype if self.dtype == torch.float32 else torch.bfloat16
            kind = FLOAT_TYPES_BY_DTYPE[dense]
            gate_up = torch.cat([self.load(n, (e, ffn, hidden), dense) for n in (gate, up)], 1)
            downs = self.load(down, (e, hidden, ffn), dense)
            return MoEWeights(router, router_bias,
                              [GroupedExperts(_bytes(gate_up), kind, (2 * ffn, hidden), gub)],
                              GroupedExperts(_bytes(downs), kind, (hidden, ffn), db))

        def row(b: torch.Tensor | None, i: int) -> torch.Tensor | None:
            return None if b is None else b[i]

        if self.int8:
            pairs = [self._int8_experts(n, (e, ffn, hidden)) for n in (gate, up)]
            gate_up = [Int8Linear(torch.cat([g[0], u[0]]), torch.cat([g[1], u[1]]), row(gub, i))
                       for i, (g, u) in enumerate(zip(*pairs, strict=True))]
            downs = [Int8Linear(c, s, row(db, i))
                     for i, (c, s) in enumerate(self._int8_experts(down, (e, hidden, ffn)))]
            return MoEWeights(router, router_bias, [DenseExperts(gate_up)], DenseExperts(downs))
        g = self.load(gate, (e, ffn, hidden), self.dtype)
        u = self.load(up, (e, ffn, hidden), self.dtype)
        d = self.load(down, (e, hidden, ffn), self.dtype)
        return MoEWeights(
            router, router_bias,
            [DenseExperts([Linear(torch.cat([g[i], u[i]]), row(gub, i)) for i in range(e)])],
            DenseExperts([Linear(d[i], row(db, i)) for i in range(e)]))

    def _bias(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A float32 bias of `shape`, or None where the file has no tensor `name`."""
        return self.load(name, shape, torch.float32) if self.has(name) else None

    def _experts(self, name: str, shape: tuple[int, int, int],
                 bias: torch.Tensor | None = None) -> GroupedExperts:
        raw, ggml_type = self.raw(name, shape)
        e, n, k = shape
        if ggml_type not in MOE_TYPES:
            raise UnsupportedTensorType(f"tensor '{name}': no grouped MoE kernel for GGML "
                                        f"type {ggml_type}")
        if raw.numel() != e * n * row_bytes(ggml_type, k):
            raise GGUFFormatError(f"tensor '{name}': {raw.numel()} bytes do not hold GGML "
                                  f"type {ggml_type} of shape {shape}")
        return GroupedExperts(raw.view(e, n, -1), ggml_type, (n, k), bias)

    def _int8_experts(self, name: str, shape: tuple[int, int, int]
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each expert's (codes, scales), re-quantized from its dequantized rows."""
        raw, ggml_type = self.raw(name, shape)
        e, n, k = shape
        per_expert = raw.view(e, -1) if e else raw.view(0, 0)
        return [quantize_rows_int8(dequantize(per_expert[i], ggml_type, (n, k), name=name))
                for i in range(e)]


def _bytes(dense: torch.Tensor) -> torch.Tensor:
    """(E, N, K) float -> its bytes (E, N, K * itemsize) uint8, as GroupedExperts holds them."""
    return dense.contiguous().view(torch.uint8)
