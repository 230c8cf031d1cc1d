"""Maps GGUF `general.architecture` to a family's config reader; loads a DecoderModel."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.errors import UnsupportedArchitecture
from engine.gguf import ModelFile
from engine.models import gemma3, gpt_oss, llama, qwen
from engine.models.common import DecoderModel
from engine.models.config import ModelConfig
from engine.models.weights import WeightLoader

FAMILIES: dict[str, Callable[[ModelFile], ModelConfig]] = {
    "llama": llama.read_config,
    "qwen2": qwen.read_qwen2_config,
    "qwen3": qwen.read_qwen3_config,
    "qwen3moe": qwen.read_qwen3moe_config,
    "gemma3": gemma3.read_config,
    "gpt-oss": gpt_oss.read_config,
}


def read_config(mf: ModelFile) -> ModelConfig:
    arch = mf.architecture
    reader = FAMILIES.get(arch)
    if reader is None:
        raise UnsupportedArchitecture(
            f"architecture '{arch}' is not supported; supported: {', '.join(sorted(FAMILIES))}")
    return reader(mf)


def load_model(mf: ModelFile, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> DecoderModel:
    return DecoderModel(read_config(mf), WeightLoader(mf, dtype, device))
