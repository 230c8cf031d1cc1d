"""Weight loading: GGUF tensors by name -> torch tensors, with shape checks.

On CPU the GGML blocks are dequantized at load into `dtype` (bf16 default, f32 for
parity tests); norms and biases stay float32. Fusions happen here, so the forward never
sees the file layout.
"""

from __future__ import annotations

import warnings

import torch

from engine.errors import GGUFFormatError
from engine.gguf import ModelFile
from engine.layers.linear import Linear
from kernels.dequant import dequantize


class WeightLoader:
    def __init__(self, model_file: ModelFile, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> None:
        self.file = model_file
        self.dtype = dtype
        self.device = torch.device(device)

    def has(self, name: str) -> bool:
        return name in self.file.tensors

    def load(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        info = self.file.tensors.get(name)
        if info is None:
            raise GGUFFormatError(f"tensor '{name}' is missing")
        if tuple(info.shape) != tuple(shape):
            raise GGUFFormatError(
                f"tensor '{name}' has shape {tuple(info.shape)}, expected {tuple(shape)}")
        with warnings.catch_warnings():  # the mmap is read-only; nothing writes to `raw`
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self.file.tensor_data(name))
        if self.device.type != "cpu":  # ship the blocks, dequantize on the device
            raw = raw.to(self.device, non_blocking=False)
        return dequantize(raw, info.ggml_type, tuple(info.shape), out_dtype=dtype, name=name)

    def vector(self, name: str, size: int) -> torch.Tensor:
        return self.load(name, (size,), torch.float32)

    def matrix(self, name: str, shape: tuple[int, int]) -> torch.Tensor:
        return self.load(name, shape, self.dtype)

    def linear(self, prefix: str, shape: tuple[int, int]) -> Linear:
        bias = None
        if self.has(prefix + ".bias"):
            bias = self.vector(prefix + ".bias", shape[0])
        return Linear(self.matrix(prefix + ".weight", shape), bias)

    def fused(self, prefixes: list[str], out_sizes: list[int], in_size: int) -> Linear:
        """Stack several linears with the same input into one (rows in `prefixes` order)."""
        parts = [self.linear(p, (o, in_size)) for p, o in zip(prefixes, out_sizes, strict=True)]
        weight = torch.cat([p.weight for p in parts])
        biases = [p.bias for p in parts]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(p.out_features,
                                                                  device=self.device)
                              for b, p in zip(biases, parts, strict=True)])
        return Linear(weight, bias)
