"""Build a running Engine for a model from one options object (CLI, server, benchmarks)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from engine.core import EngineCore
from engine.engine import Engine
from engine.errors import InvalidRequest
from engine.gguf import ModelFile
from engine.kernel_select import use_triton
from engine.llm import DTYPES
from engine.loader import (
    LoadedModel,
    chat_template_for,
    configure_cpu_threads,
    load,
    resolve_device,
    resolve_model_path,
)
from engine.models.common import DecoderModel
from engine.models.config import ModelConfig
from engine.models.registry import read_config
from engine.models.weights import WeightLoader
from engine.runner import ModelRunner
from engine.scheduler.scheduler import SchedulerConfig
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

PAGE_SIZE = 16


@dataclass(frozen=True, slots=True)
class EngineOptions:
    sessions: int = 4  # resident sequences
    context: int = 4096  # tokens per session: prompt + output
    prefill_chunk: int = 512
    mixed_batch: bool = True
    itl_target_ms: float | str | None = "auto"
    kv_quant: str = "f16"
    dtype: str = "auto"  # weights: auto (int8 on CPU, bf16 on GPU), bf16, f32, int8
    max_pending_per_client: int | None = 16
    prefix_cache_fraction: float = 0.5  # extra full-layer pages for cached prefixes
    device: str = "auto"  # auto: the GPU when present
    cuda_graphs: bool = True  # replay captured decode steps on a GPU (never on the CPU)
    # With graphs: launch the next decode step from the sampled ids on the device before
    # the host reads them, so the host's work between steps overlaps the device's.
    look_ahead: bool = True
    # Weight layout: ggml keeps the file's blocks (fused dequant kernels), q8 too with the
    # Q4_K products on 8-bit activations (kernels/qint.py), bf16 dense matrices in `dtype`,
    # hybrid q8's blocks for small calls and bf16 copies for large ones (`dense_rows`);
    # auto: dense on the CPU, on a GPU the faster of ggml and bf16 as measured at load
    # (engine/layout_tune.py).
    weights: str = "auto"
    # The hybrid layout's threshold: calls of this many rows or more multiply bf16 copies
    # of the weights, fewer q8's blocks. None: measured at load on a GPU
    # (engine/layout_tune.py's choose_dense_rows); needed elsewhere.
    dense_rows: int | None = None
    # Build the kernels of the first prefill and mixed steps and capture the decode graphs
    # at load (a GPU only; ModelRunner.warm_up), not in the first requests' steps.
    warm_up: bool = True
    # With the q8 layout on a GPU: time the matrix-unit kernel's candidate tiles on the
    # model's shapes at load and take the fastest (engine/tile_tune.py; the bits do not
    # depend on the tile).
    tune_tiles: bool = True
    # Where the tuned tiles are kept between loads (engine/tile_tune.py's cache_path): "auto"
    # ($MBUFO_TILE_CACHE, else the user's cache directory), a path, or None for no file.
    tile_cache: str | None = "auto"


def pages_per_group(cfg: ModelConfig, opts: EngineOptions) -> dict[str, int]:
    """Pages for `sessions` x `context`; sliding layers only need window + one chunk."""
    per_session_full = -(-opts.context // PAGE_SIZE)
    pages = {"full": int(opts.sessions * per_session_full * (1 + opts.prefix_cache_fraction))}
    if cfg.sliding_window:
        kept = min(opts.context, cfg.sliding_window + opts.prefill_chunk) + 2 * PAGE_SIZE
        pages["sliding"] = int(opts.sessions * -(-kept // PAGE_SIZE)
                               * (1 + opts.prefix_cache_fraction))
    return pages


def wants_warm_up(opts: EngineOptions, runner: ModelRunner) -> bool:
    """Warm-up builds Triton kernels and captures graphs: a GPU's path only."""
    return opts.warm_up and runner.triton and torch.device(runner.model.device).type == "cuda"


def build_core(loaded: LoadedModel, opts: EngineOptions) -> EngineCore:
    cfg = loaded.config
    context = min(opts.context, cfg.context_length)
    runner = ModelRunner(loaded.model, pages_per_group(cfg, opts), PAGE_SIZE, opts.kv_quant,
                         cuda_graphs=opts.cuda_graphs, max_context=context,
                         max_rows=opts.sessions)
    if wants_warm_up(opts, runner):
        # every decode graph a row of up to the context can need (~40 at 32K keys): a
        # capture while serving would stall every stream's step for its duration
        log.info("warm-up: %.1f s", runner.warm_up(opts.prefill_chunk, context))
    sched = SchedulerConfig(max_sessions=opts.sessions, context=context,
                            prefill_chunk=opts.prefill_chunk, mixed_batch=opts.mixed_batch,
                            itl_target_ms=opts.itl_target_ms,
                            max_pending_per_client=opts.max_pending_per_client)
    return EngineCore(runner, loaded.tokenizer, sched, vocab_size=cfg.vocab_size,
                      look_ahead=opts.look_ahead)


def load_for(model: str | os.PathLike, opts: EngineOptions) -> LoadedModel:
    """engine.loader.load with the options' dtype, device and weight layout; on a GPU with
    the Triton kernels, `weights="auto"` measures both layouts first (engine/layout_tune.py),
    and the q8 layout its tiles (engine/tile_tune.py, unless `tune_tiles` is off)."""
    device = resolve_device(opts.device)
    dtype = DTYPES[opts.dtype]
    tune = (opts.weights == "auto" and device.type == "cuda" and dtype in (None, torch.bfloat16)
            and use_triton(device))
    if opts.dense_rows is not None and opts.weights != "hybrid":
        raise InvalidRequest(f"dense_rows is the hybrid weight layout's, not {opts.weights!r}'s")
    if opts.weights == "auto" and not tune:
        return load(model, dtype, opts.device)
    hybrid_tune = opts.weights == "hybrid" and opts.dense_rows is None
    if hybrid_tune and not (device.type == "cuda" and use_triton(device)):
        raise InvalidRequest("the hybrid weight layout measures its threshold on a GPU with "
                             "the Triton kernels, and there is none here: use another "
                             "weight layout (or give dense_rows)")
    start = time.perf_counter()  # as load() does, with the layout passed to the weights
    if device.type == "cpu":
        configure_cpu_threads(int(os.environ.get("MBUFO_CPU_THREADS", "0")) or None)
    path = resolve_model_path(model)
    mf = ModelFile.open(path)
    cfg = read_config(mf)
    tokenizer = Tokenizer.from_metadata(mf.metadata)
    layout, choice, dense_rows = opts.weights, None, opts.dense_rows
    if tune or hybrid_tune:
        from engine.layout_tune import measure_layout

        choice = measure_layout(mf, cfg, device, sessions=opts.sessions, context=opts.context,
                                kv_quant=opts.kv_quant, hybrid=hybrid_tune)
        layout, dense_rows = choice.layout, choice.dense_rows
    tiles = None
    if layout in ("q8", "hybrid") and opts.tune_tiles and device.type == "cuda" and \
            use_triton(device):
        from engine.tile_tune import tune_tiles

        tiles = tune_tiles(mf, device, opts.tile_cache)
    decoder = DecoderModel(cfg, WeightLoader(mf, dtype, device, layout, dense_rows))
    return LoadedModel(path, mf, cfg, decoder, tokenizer, chat_template_for(mf, tokenizer),
                       time.perf_counter() - start, choice, tiles)


def build_engine(model: str | os.PathLike, opts: EngineOptions | None = None,
                 loaded: LoadedModel | None = None) -> Engine:
    """Load `model` (a path or 'default') unless `loaded` is given; returns a started Engine."""
    opts = opts or EngineOptions()
    loaded = loaded or load_for(model, opts)
    return Engine(build_core(loaded, opts), name=loaded.path.stem, loaded=loaded).start()
