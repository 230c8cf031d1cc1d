"""Multi-model router: one port, `model` picks a loaded engine; the first loaded is the default.

Models load and unload at run time. Loading (reading the GGUF, dequantizing, building the
engine) runs in a worker thread, so the event loop keeps serving the models already
loaded; one load runs at a time, so the memory budget check never races another load.
The budget (`memory_gb`) counts what engine/planner.py counts — weights, KV for
sessions x context, one prefill chunk — plus the prefix-cache pages build_engine adds.
Unloading a model stops only its engine: its own streams end with an abort, the other
models' streams never notice.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any

from appliance.server.errors import Conflict, NotFound
from appliance.settings import Settings
from engine.build import PAGE_SIZE, EngineOptions, build_engine
from engine.engine import Engine

log = logging.getLogger(__name__)

DEFAULT_ALIASES = ("", "default")  # `model` values (besides None) meaning the default model
GIB = 1 << 30


@dataclass(slots=True)
class ModelHandle:
    name: str
    source: str  # what was loaded: "default" or a path
    engine: Engine
    options: EngineOptions
    memory_bytes: int
    created: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0  # requests of this model the server is running
    is_unloading: bool = False
    client_quotas: dict[str, int | None] = field(default_factory=dict)  # set on the core

    @property
    def tokenizer(self) -> Any:
        return self.engine.loaded.tokenizer

    @property
    def chat_template(self) -> Any:
        return self.engine.loaded.chat_template

    @property
    def vocab_size(self) -> int:
        return int(self.engine.loaded.config.vocab_size)

    @property
    def context(self) -> int:
        """Tokens per session (prompt + output) the engine accepts."""
        return int(self.engine.core.config.context)

    def describe(self) -> dict[str, Any]:
        cfg = self.engine.loaded.config
        return {"name": self.name, "source": self.source, "architecture": cfg.architecture,
                "sessions": self.options.sessions, "context": self.context,
                "kv_quant": self.options.kv_quant, "memory_bytes": self.memory_bytes,
                "loaded_at": self.created, "in_flight": self.num_in_flight}


@dataclass(frozen=True, slots=True)
class LoadSpec:
    name: str  # the name clients use
    source: str  # "default" or a GGUF path
    options: EngineOptions


def engine_options(settings: Settings) -> EngineOptions:
    itl: float | str | None = settings.itl_target_ms
    if itl == "off":
        itl = None
    elif itl != "auto":
        itl = float(itl)
    return EngineOptions(sessions=settings.sessions, context=settings.context,
                         prefill_chunk=settings.prefill_chunk, mixed_batch=settings.mixed_batch,
                         itl_target_ms=itl, kv_quant=settings.kv_quant, dtype=settings.dtype,
                         weights=settings.weights,
                         tile_cache=str(settings.data_dir / "cache" / "q8_tiles.json"))


def planned_bytes(source: str, opts: EngineOptions) -> int:
    """Memory the engine for `source` will hold (engine/planner.py, plus prefix-cache KV)."""
    import torch

    from engine.gguf import ModelFile
    from engine.loader import resolve_model_path
    from engine.models.registry import read_config
    from engine.planner import plan

    mf = ModelFile.open(resolve_model_path(source))
    cfg = read_config(mf)
    backend = "cpu"
    if torch.cuda.is_available():  # hybrid: the bf16 copies beside the blocks
        backend = "hybrid" if opts.weights == "hybrid" else "gpu"
    p = plan(mf, cfg, sessions=opts.sessions, context=min(opts.context, cfg.context_length),
             kv_quant=opts.kv_quant, page_size=PAGE_SIZE, prefill_chunk=opts.prefill_chunk,
             backend=backend)
    return p.total_bytes + int(p.kv_bytes_total * opts.prefix_cache_fraction)


class ModelRouter:
    def __init__(self, settings: Settings, registry: Any = None) -> None:
        self.settings = settings
        self.registry = registry
        self.base_options = engine_options(settings)
        self.max_in_flight = 512  # per model; beyond it requests get 503 overloaded
        self._models: dict[str, ModelHandle] = {}  # load order: the first is the default
        self._loading: dict[str, str] = {}  # name -> source, while a load runs
        self._lock = asyncio.Lock()

    # -- routing -------------------------------------------------------------------------
    def get(self, name: str | None) -> ModelHandle:
        """The loaded model `name`; None, "" and "default" mean the first loaded."""
        if name is not None and name in self._models:
            return self._models[name]
        if name is None or name in DEFAULT_ALIASES:
            for handle in self._models.values():
                return handle
            raise NotFound("no model is loaded", code="model_not_found", param="model")
        raise NotFound(f"the model '{name}' is not loaded (loaded: "
                       f"{', '.join(self._models) or 'none'})", code="model_not_found",
                       param="model")

    def handles(self) -> list[ModelHandle]:
        return list(self._models.values())

    def loading(self) -> dict[str, str]:
        return dict(self._loading)

    @property
    def budget_bytes(self) -> int | None:
        gb = self.settings.memory_gb
        return None if gb is None else int(gb * GIB)

    def used_bytes(self) -> int:
        return sum(h.memory_bytes for h in self._models.values())

    # -- load / unload -------------------------------------------------------------------
    def resolve(self, ref: str, *, sessions: int | None = None, context: int | None = None,
                kv_quant: str | None = None) -> LoadSpec:
        """A registry name, 'default' or a path -> what to load, with its options."""
        record = self._registered(ref)
        opts = self.base_options
        if record is not None:
            opts = replace(opts, **{k: v for k in ("sessions", "context", "kv_quant")
                                    if (v := getattr(record, k, None)) is not None})
            name, source = record.name, str(record.path)
        else:
            from pathlib import Path

            name = ref if ref == "default" else Path(ref).stem
            source = ref
        overrides = {"sessions": sessions, "context": context, "kv_quant": kv_quant}
        opts = replace(opts, **{k: v for k, v in overrides.items() if v is not None})
        return LoadSpec(name, source, opts)

    def _registered(self, ref: str) -> Any:
        if self.registry is None:
            return None
        from appliance.db import StateError

        try:
            return self.registry.get(ref)
        except StateError as exc:
            if exc.status == 404:
                return None
            raise

    async def load(self, spec: LoadSpec) -> ModelHandle:
        async with self._lock:
            if spec.name in self._models:
                raise Conflict(f"the model '{spec.name}' is already loaded",
                               code="model_already_loaded")
            self._loading[spec.name] = spec.source
            try:
                need = await asyncio.to_thread(planned_bytes, spec.source, spec.options)
                self._check_budget(spec.name, need)
                log.info("loading model '%s' from %s", spec.name, spec.source)
                engine = await asyncio.to_thread(build_engine, spec.source, spec.options)
            finally:
                del self._loading[spec.name]
            engine.name = spec.name
            handle = ModelHandle(spec.name, spec.source, engine, spec.options, need)
            self._models[spec.name] = handle
            log.info("model '%s' loaded (%.2f GiB planned)", spec.name, need / GIB)
            _freeze()
            return handle

    def _check_budget(self, name: str, need: int) -> None:
        budget = self.budget_bytes
        if budget is not None and self.used_bytes() + need > budget:
            raise Conflict(
                f"loading '{name}' needs {need / GIB:.2f} GiB; {self.used_bytes() / GIB:.2f} "
                f"of the {budget / GIB:.2f} GiB budget (memory_gb) are in use by "
                f"{', '.join(self._models) or 'nothing'}", code="insufficient_memory")

    async def unload(self, name: str) -> None:
        async with self._lock:
            handle = self._models.pop(name, None)
            if handle is None:
                raise NotFound(f"the model '{name}' is not loaded", code="model_not_found")
        await self._stop(handle)

    async def stop_all(self) -> None:
        handles, self._models = list(self._models.values()), {}
        for handle in handles:
            await self._stop(handle)

    async def _stop(self, handle: ModelHandle) -> None:
        from engine.grammar import forget_tokenizer

        handle.is_unloading = True
        log.info("unloading model '%s' (%d requests in flight)", handle.name,
                 handle.num_in_flight)
        await asyncio.to_thread(handle.engine.stop)
        forget_tokenizer(handle.tokenizer)
        gc.unfreeze()  # let the collector find the unloaded model's cycles
        _freeze()


def _freeze() -> None:
    """Move every object alive now (model tables, vocabularies) out of the collector's
    sight: a full collection then scans only what requests create, instead of pausing
    for tens of milliseconds at random requests and tokens."""
    gc.collect()
    gc.freeze()
