"""The q8 layout's matrix-unit tiles, chosen at load from measured cost.

kernels/qint.py multiplies more than a few rows of x on the matrix unit with one tile per
bound of rows (qint.TILE_BOUNDS: up to 16, 32, 64 and more). Its super-block sums are exact
integers, so the tile changes no bit of the result and may be chosen by speed alone. Which
tile is fastest depends on the chip (registers, shared memory and matrix instructions differ
between the H200 and the appliance's gfx1151, where no tile has been timed by hand), so at
load, with the q8 layout on a GPU, every candidate of each bound (qint.TILE_CANDIDATES, the
default first) is timed on the model's own Q4_K and Q6_K linear shapes at the bound's rows
(16, 32, 64 and 512 for prefill chunks), each weight read from memory as decode reads it
(layout_tune.gpu_measure: copies beyond the L2, replayed in a CUDA graph), each shape
weighted by how many linears have it. A candidate replaces the default when more than
TIE_MARGIN faster; qint.TUNED_TILES holds the choice for the process. A candidate that
fails to build or run is left out (its error kept in the record), and a failure of the
whole tuning keeps the defaults.

Cost: one build of each candidate kernel (Triton keeps the builds on disk, so only the
first load pays: a few seconds each) and a few graph replays per candidate and shape. The
choice is logged, kept in `LoadedModel.tile_choice` and printed by `mbufo inspect MODEL
--device cuda` when the layout is q8.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.gguf import ModelFile
from engine.layers.ggml_linear import ACT8_TYPES
from engine.layout_tune import LinearShape, gpu_measure, linear_shapes

log = logging.getLogger(__name__)

ROWS_OF_BOUND = {16: 16, 32: 32, 64: 64, 1 << 62: 512}  # the rows each bound is timed at
TIE_MARGIN = 0.03  # the default tile stays unless a candidate is more than 3% faster

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
                "errors": dict(self.errors)}


def choose_tiles(shapes: list[LinearShape], backend: str, measure: TileMeasure) -> TileChoice:
    """The fastest candidate per (type, row bound) over `shapes` (the q8 types' linears),
    timed by `measure`; see the module docstring."""
    from kernels.qint import ACT8_STORED, TILE_BOUNDS, TILE_CANDIDATES

    candidates = TILE_CANDIDATES[backend]
    totals: dict[tuple[int, int], dict[tuple, float]] = {}
    errors: dict[str, str] = {}
    for s in shapes:  # shape by shape: the measure keeps one shape's weights at a time
        held = ACT8_STORED[s.ggml_type]
        for bound in TILE_BOUNDS:
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
    return TileChoice(backend, tiles, totals, errors)


def apply_tiles(choice: TileChoice) -> None:
    """The chosen tiles into kernels/qint.py's TUNED_TILES (this process's launches)."""
    from kernels.qint import TILE_CANDIDATES, TUNED_TILES

    for (held, bound), tile in choice.tiles.items():
        if tile == TILE_CANDIDATES[choice.backend][bound][0]:
            TUNED_TILES.pop((choice.backend, held, bound), None)
        else:
            TUNED_TILES[choice.backend, held, bound] = tile


def gpu_tile_measure(device: torch.device) -> TileMeasure:
    """A TileMeasure on `device`: layout_tune.gpu_measure's q8 product under each tile."""
    from kernels.qint import forced_tile

    measure = gpu_measure(device)

    def timed(tile: tuple, ggml_type: int, n: int, k: int, m: int) -> float:
        with forced_tile(tile):
            return measure("q8", ggml_type, n, k, m)

    return timed


def tune_tiles(mf: ModelFile, device: torch.device) -> TileChoice | None:
    """choose_tiles on `device` for the q8 linears of `mf`, applied (apply_tiles); None when
    the model has none. A failure keeps the default tiles (logged)."""
    shapes = [s for s in linear_shapes(mf) if s.ggml_type in ACT8_TYPES]
    if not shapes:
        return None
    backend = "hip" if torch.version.hip else "cuda"
    try:
        choice = choose_tiles(shapes, backend, gpu_tile_measure(device))
    except Exception:
        log.exception("q8 tile tuning failed: the default tiles stay")
        return None
    apply_tiles(choice)
    log.info("q8 tiles: %s", choice.as_dict()["tiles"])
    return choice
