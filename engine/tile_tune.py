"""The q8 layout's matrix-unit tiles, chosen at load from measured cost.

kernels/qint.py multiplies more than a few rows of x on the matrix unit with one tile per
bound of rows (qint_mm.TILE_BOUNDS: up to 16, 32, 64 and more). Its super-block sums are exact
integers, so the tile changes no bit of the result and may be chosen by speed alone. Which
tile is fastest depends on the chip (registers, shared memory and matrix instructions differ
between the H200 and the appliance's gfx1151, where no tile has been timed by hand), so at
load, with the q8 layout on a GPU, every candidate of each bound (qint_mm.TILE_CANDIDATES, the
default first; not the bounds whose rows kernels/qint_mma.py's Gluon kernel takes on
NVIDIA: `gluon_bounds`) is timed on the model's own Q4_K and Q6_K linear shapes at the
bound's rows (16, 32, 64 and 512 for prefill chunks), each weight read from memory as
decode reads it (layout_tune.gpu_measure: copies beyond the L2, replayed in a CUDA graph),
each shape weighted by how many linears have it. A candidate replaces the default when more than
TIE_MARGIN faster; qint_mm.TUNED_TILES holds the choice for the process. A candidate that
fails to build or run is left out (its error kept in the record), and a failure of the
whole tuning keeps the defaults.

Cost: one build of each candidate kernel (Triton keeps the builds on disk, so only the
first load pays: a few seconds each) and a few graph replays per candidate and shape. The
choice is kept in a JSON file (`cache_path`: $MBUFO_TILE_CACHE, else
$XDG_CACHE_HOME/mbufo/q8_tiles.json; the appliance's data directory when it serves), keyed
by everything it depends on (the device's name, backend, torch and Triton versions,
the sources of kernels/qint.py, qint_mm.py and qint_gemv.py, the candidates and the
model's shapes), so a later load of the same model on the same device takes it without
timing or building any candidate. A
missing, unreadable or foreign file is a miss; a file that cannot be written is logged and
the load goes on. The choice is logged, kept in `LoadedModel.tile_choice` (`cached` when
read from the file) and printed by `mbufo inspect MODEL --device cuda` when the layout is
q8.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.cache_files import locked
from engine.gguf import ModelFile
from engine.layers.ggml_linear import ACT8_TYPES
from engine.layout_tune import LinearShape, gpu_measure, linear_shapes

log = logging.getLogger(__name__)

ROWS_OF_BOUND = {16: 16, 32: 32, 64: 64, 1 << 62: 512}  # the rows each bound is timed at
TIE_MARGIN = 0.03  # the default tile stays unless a candidate is more than 3% faster
CACHE_VERSION = 1  # of the cache file's records
CACHE_ENTRIES = 64  # records kept in the file (the oldest dropped)

# (tile, ggml_type as in the file, out, in, rows) -> seconds per product
TileMeasure = Callable[[tuple, int, int, int, int], float]


def _tile_name(tile: tuple) -> str:
    """(16, 64, 4, None, 120) -> '16x64 on 4 warps, <= 120 registers'."""
    bm, bn, warps, stages, regs = (*tile, None, None)[:5]
    name = f"{bm}x{bn} on {warps} warps"
    if stages:
        name += f", {stages} stage{'s' * (stages > 1)}"
    return name + (f", <= {regs} registers" if regs else "")


@dataclass(frozen=True)
class TileChoice:
    backend: str
    # (type as held, row bound) -> the chosen tile
    tiles: dict[tuple[int, int], tuple] = field(default_factory=dict)
    # (type as held, row bound) -> tile -> ms of all of the model's linears of that type
    ms: dict[tuple[int, int], dict[tuple, float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # candidate -> why it was left out
    cached: bool = False  # read from the cache file, not timed in this process
    # (type as held, row bound) not timed: kernels/qint_mma.py's Gluon kernel takes them
    skipped: tuple[tuple[int, int], ...] = ()

    def as_dict(self) -> dict:
        from kernels.qint import Q6_K_A
        from kernels.qtiles import Q4_K

        names = {Q4_K: "Q4_K", Q6_K_A: "Q6_K"}  # the types as held

        def key(qtype: int, bound: int) -> str:
            rows = "more" if bound == max(ROWS_OF_BOUND) else f"<= {bound}"
            return f"{names.get(qtype, qtype)} rows {rows}"

        return {"backend": self.backend,
                "tiles": {key(*k): _tile_name(t) for k, t in self.tiles.items()},
                "ms": {key(*k): {_tile_name(t): round(v, 4) for t, v in d.items()}
                       for k, d in self.ms.items()},
                "errors": dict(self.errors), "cached": self.cached,
                "skipped": [key(*k) for k in self.skipped]}


def choose_tiles(shapes: list[LinearShape], backend: str, measure: TileMeasure,
                 skip: frozenset[tuple[int, int]] = frozenset()) -> TileChoice:
    """The fastest candidate per (type, row bound) over `shapes` (the q8 types' linears),
    timed by `measure`, except the (type as held, bound) pairs in `skip` (no tile of
    _qint_mm_kernel serves them: gluon_bounds); see the module docstring."""
    from kernels.qint import ACT8_STORED
    from kernels.qint_mm import TILE_BOUNDS, TILE_CANDIDATES

    candidates = TILE_CANDIDATES[backend]
    totals: dict[tuple[int, int], dict[tuple, float]] = {}
    errors: dict[str, str] = {}
    for s in shapes:  # shape by shape: the measure keeps one shape's weights at a time
        held = ACT8_STORED[s.ggml_type]
        for bound in TILE_BOUNDS:
            if (held, bound) in skip:
                continue
            for tile in candidates[bound]:
                times = totals.setdefault((held, bound), {})
                if times.get(tile) == math.inf:
                    continue  # failed on an earlier shape
                try:
                    seconds = measure(tile, s.ggml_type, s.out_features, s.in_features,
                                      ROWS_OF_BOUND[bound])
                except Exception as exc:  # a candidate this device cannot build or run
                    errors[_tile_name(tile)] = f"{type(exc).__name__}: {exc}"[:300]
                    times[tile] = math.inf
                    continue
                times[tile] = times.get(tile, 0.0) + 1e3 * s.count * seconds
    tiles = {}
    for (held, bound), times in totals.items():
        default = candidates[bound][0]
        best = min(times, key=times.get)
        fast = times[best] < (1 - TIE_MARGIN) * times[default] or times[default] == math.inf
        tiles[held, bound] = best if fast and times[best] < math.inf else default
    return TileChoice(backend, tiles, totals, errors, skipped=tuple(sorted(skip)))


def apply_tiles(choice: TileChoice) -> None:
    """The chosen tiles into kernels/qint_mm.py's TUNED_TILES (this process's launches)."""
    from kernels.qint_mm import TILE_CANDIDATES, TUNED_TILES

    for (held, bound), tile in choice.tiles.items():
        if tile == TILE_CANDIDATES[choice.backend][bound][0]:
            TUNED_TILES.pop((choice.backend, held, bound), None)
        else:
            TUNED_TILES[choice.backend, held, bound] = tile


def gpu_tile_measure(device: torch.device) -> TileMeasure:
    """A TileMeasure on `device`: layout_tune.gpu_measure's q8 product under each tile."""
    from kernels.qint_mm import forced_tile

    measure = gpu_measure(device)

    def timed(tile: tuple, ggml_type: int, n: int, k: int, m: int) -> float:
        with forced_tile(tile):
            return measure("q8", ggml_type, n, k, m)

    return timed


def cache_path(setting: str | os.PathLike | None = "auto") -> Path | None:
    """The cache file for a setting: "auto" is $MBUFO_TILE_CACHE ("off": none), else
    $XDG_CACHE_HOME/mbufo/q8_tiles.json (~/.cache when unset); None or "off": none; else
    the path given."""
    if setting == "auto":
        setting = os.environ.get("MBUFO_TILE_CACHE") or Path(
            os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mbufo" / "q8_tiles.json"
    if setting is None or str(setting) in ("", "off"):
        return None
    return Path(setting)


def gluon_bounds(held_types: set[int], backend: str, device: torch.device,
                 ) -> frozenset[tuple[int, int]]:
    """The (type as held, row bound) pairs whose rows kernels/qint_mma.py's Gluon kernel
    multiplies on `device` (qint.mma_path at the bound's rows), so no tile is timed."""
    from kernels.qint import mma_path
    from kernels.qint_mm import TILE_BOUNDS

    return frozenset((held, bound) for held in held_types for bound in TILE_BOUNDS
                     if mma_path(ROWS_OF_BOUND[bound], held, 0, backend, device))


def cache_key(shapes: list[LinearShape], backend: str, device_name: str,
              skip: frozenset[tuple[int, int]] = frozenset()) -> str:
    """A digest of everything a choice depends on (see the module docstring)."""
    from kernels import qint, qint_gemv, qint_mm
    from kernels.triton_util import triton

    # the launch and both kernels' sources (qint_mm's tiles read qint_gemv's word helpers)
    source = hashlib.sha256(b"".join(Path(m.__file__).read_bytes()
                                     for m in (qint, qint_mm, qint_gemv))).hexdigest()
    parts = [CACHE_VERSION, device_name, backend, torch.__version__,
             getattr(triton, "__version__", None),
             source, repr(qint_mm.TILE_BOUNDS), repr(qint_mm.TILE_CANDIDATES[backend]),
             sorted((s.ggml_type, s.out_features, s.in_features, s.count) for s in shapes),
             sorted(skip)]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _records(path: Path) -> dict:
    """The cache file's records by key; {} when missing or unreadable (logged)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("q8 tile cache %s unreadable (%s): timing the tiles", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def read_cached(path: Path, key: str) -> TileChoice | None:
    """The choice kept under `key`, or None (missing, or not a valid record of today's
    candidates)."""
    from kernels.qint_mm import TILE_CANDIDATES

    record = _records(path).get(key)
    try:
        backend = record["backend"]
        tiles = {(int(held), int(bound)): tuple(tile) for held, bound, tile in record["tiles"]}
        ms = {(int(held), int(bound)): {tuple(tile): math.inf if v is None else float(v)
                                        for tile, v in times}
              for held, bound, times in record["ms"]}
        errors = {str(k): str(v) for k, v in record["errors"].items()}
        skipped = tuple((int(held), int(bound)) for held, bound in record.get("skipped", ()))
        if not all(tile in TILE_CANDIDATES[backend][bound] for (_, bound), tile in tiles.items()):
            return None
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    return TileChoice(backend, tiles, ms, errors, cached=True, skipped=skipped)


def write_cached(path: Path, key: str, choice: TileChoice) -> None:
    """Keeps `choice` under `key` beside the file's other records as they are now (read
    again under the file's lock: another process may have written since this one read;
    the newest CACHE_ENTRIES stay), written whole to a temporary file and renamed over the
    old one; a failure is logged, not raised."""
    def plain(v: float) -> float | None:
        return v if math.isfinite(v) else None  # a failed candidate: JSON has no inf

    record = {"backend": choice.backend,
              "tiles": [[h, b, list(t)] for (h, b), t in choice.tiles.items()],
              "ms": [[h, b, [[list(t), plain(v)] for t, v in d.items()]]
                     for (h, b), d in choice.ms.items()],
              "errors": dict(choice.errors), "skipped": [list(k) for k in choice.skipped]}
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):
            records = _records(path)
            records.pop(key, None)
            records[key] = record
            tmp.write_text(json.dumps(dict(list(records.items())[-CACHE_ENTRIES:])))
            os.replace(tmp, path)
    except OSError as exc:
        log.warning("q8 tile cache %s not written (%s): the next load times again", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def tuned_choice(shapes: list[LinearShape], backend: str, device_name: str,
                 measure: TileMeasure, cache: Path | None,
                 skip: frozenset[tuple[int, int]] = frozenset()) -> TileChoice:
    """The cached choice for these shapes on this device, else choose_tiles' (then kept)."""
    if cache is None:
        return choose_tiles(shapes, backend, measure, skip)
    key = cache_key(shapes, backend, device_name, skip)
    if (hit := read_cached(cache, key)) is not None:
        return hit
    choice = choose_tiles(shapes, backend, measure, skip)
    write_cached(cache, key, choice)
    return choice


def tune_tiles(mf: ModelFile, device: torch.device,
               cache: str | os.PathLike | None = "auto") -> TileChoice | None:
    """tuned_choice on `device` for the q8 linears of `mf` (the cache file of `cache_path
    (cache)`), applied (apply_tiles); None when the model has none. A failure keeps the
    default tiles (logged)."""
    shapes = [s for s in linear_shapes(mf) if s.ggml_type in ACT8_TYPES]
    if not shapes:
        return None
    backend = "hip" if torch.version.hip else "cuda"
    from kernels.qint import ACT8_STORED

    skip = gluon_bounds({ACT8_STORED[s.ggml_type] for s in shapes}, backend, device)
    try:
        choice = tuned_choice(shapes, backend, torch.cuda.get_device_name(device),
                              gpu_tile_measure(device), cache_path(cache), skip)
    except Exception:
        log.exception("q8 tile tuning failed: the default tiles stay")
        return None
    apply_tiles(choice)
    log.info("q8 tiles%s: %s", " (cached)" * choice.cached, choice.as_dict()["tiles"])
    return choice
