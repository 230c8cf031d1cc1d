"""engine/tile_tune.py's choice of the q8 matrix-unit tiles, on a fake clock (the GPU
measure itself runs in the device tests through every q8 load)."""

from __future__ import annotations

import json
import math
import threading

import pytest
from gguf import GGMLQuantizationType as T

from engine.layout_tune import LinearShape
from engine.tile_tune import (
    TIE_MARGIN,
    TileChoice,
    apply_tiles,
    cache_key,
    cache_path,
    choose_tiles,
    gluon_bounds,
    read_cached,
    tuned_choice,
)
from kernels import qint_mm
from kernels.qint import Q6_K_A
from kernels.qint_mm import TILE_BOUNDS, TILE_CANDIDATES, TUNED_TILES, tiled_tile

Q4K, Q6K = int(T.Q4_K), int(T.Q6_K)
SHAPES = [LinearShape(Q4K, 4096, 4096, 64), LinearShape(Q4K, 14336, 4096, 64),
          LinearShape(Q6K, 4096, 14336, 16)]


@pytest.fixture(autouse=True)
def clean_tuned():
    TUNED_TILES.clear()
    yield
    TUNED_TILES.clear()


def fake(costs: dict, calls: list | None = None, fail: tuple | None = None):
    """A TileMeasure: seconds = the tile's factor (1.0 unless in costs) x n x k x m / 1e15."""
    def measure(tile, ggml_type, n, k, m):
        if calls is not None:
            calls.append((tile, ggml_type, n, k, m))
        if tile == fail:
            raise RuntimeError("out of shared memory")
        return costs.get((ggml_type, tile), 1.0) * n * k * m / 1e15
    return measure


def test_the_fastest_candidate_wins_past_the_margin_and_the_default_on_a_near_tie():
    cuda = TILE_CANDIDATES["cuda"]
    fast16, near32 = cuda[16][1], cuda[32][1]
    choice = choose_tiles(SHAPES, "cuda", fake({(Q4K, fast16): 0.8,
                                                (Q4K, near32): 1 - TIE_MARGIN / 2}))
    assert choice.tiles[int(T.Q4_K), 16] == fast16
    assert choice.tiles[int(T.Q4_K), 32] == cuda[32][0]  # within the margin: the default
    assert choice.tiles[Q6_K_A, 16] == cuda[16][0]  # a type's times are its own
    # every (type, bound) timed, each candidate's ms the count-weighted sum of its shapes
    assert set(choice.tiles) == {(t, b) for t in (int(T.Q4_K), Q6_K_A) for b in TILE_BOUNDS}
    default_ms = choice.ms[int(T.Q4_K), 16][cuda[16][0]]
    want = 1e3 * 64 * (4096 * 4096 + 14336 * 4096) * 16 / 1e15
    assert default_ms == pytest.approx(want)
    assert choice.ms[int(T.Q4_K), 16][fast16] == pytest.approx(0.8 * want)


def test_each_bound_is_timed_at_its_rows_shape_by_shape():
    calls: list = []
    choose_tiles(SHAPES, "hip", fake({}, calls))
    per_shape = sum(len(TILE_CANDIDATES["hip"][b]) for b in TILE_BOUNDS)
    assert len(calls) == per_shape * len(SHAPES)
    # a shape's calls are together (the GPU measure keeps one shape's weights at a time)
    shapes = [(c[1], c[2], c[3]) for c in calls]
    assert shapes == sorted(shapes, key=[(s.ggml_type, s.out_features, s.in_features)
                                         for s in SHAPES].index)
    assert {c[4] for c in calls} == {16, 32, 64, 512}


def test_a_failing_candidate_is_left_out_and_recorded():
    cuda = TILE_CANDIDATES["cuda"]
    bad = cuda[64][1]
    calls: list = []
    choice = choose_tiles(SHAPES, "cuda", fake({(Q4K, bad): 0.1}, calls, fail=bad))
    assert choice.tiles[int(T.Q4_K), 64] != bad and choice.ms[int(T.Q4_K), 64][bad] == math.inf
    assert any("out of shared memory" in why for why in choice.errors.values())
    # not timed again on the next shapes of its type and bound
    assert sum(1 for c in calls if c[0] == bad and c[4] == 64 and c[1] == Q4K) == 1
    # a failing default: the fastest that ran
    default = cuda[16][0]
    choice = choose_tiles(SHAPES, "cuda", fake({}, fail=default))
    assert choice.tiles[int(T.Q4_K), 16] != default
    assert choice.ms[int(T.Q4_K), 16][choice.tiles[int(T.Q4_K), 16]] < math.inf


def test_applied_tiles_serve_the_launches_and_the_defaults_clear_them():
    cuda = TILE_CANDIDATES["cuda"]
    other = cuda[16][1]
    apply_tiles(TileChoice("cuda", {(int(T.Q4_K), 16): other, (Q6_K_A, 16): cuda[16][0]}))
    assert tiled_tile(9, "cuda", int(T.Q4_K)) == other
    assert tiled_tile(16, "cuda", Q6_K_A) == cuda[16][0]
    assert tiled_tile(17, "cuda", int(T.Q4_K)) == cuda[32][0]  # another bound
    assert tiled_tile(9, "hip", int(T.Q4_K)) == TILE_CANDIDATES["hip"][16][0]
    with qint_mm.forced_tile(cuda[64][1]):
        assert tiled_tile(9, "cuda", int(T.Q4_K)) == cuda[64][1]
        seen = []  # another thread (a model serving while one is tuned) keeps its tiles
        worker = threading.Thread(target=lambda: seen.append(tiled_tile(9, "cuda", int(T.Q4_K))))
        worker.start()
        worker.join()
        assert seen == [other]
    apply_tiles(TileChoice("cuda", {(int(T.Q4_K), 16): cuda[16][0]}))
    assert tiled_tile(9, "cuda", int(T.Q4_K)) == cuda[16][0] and not TUNED_TILES


def test_the_record_names_types_bounds_and_tiles():
    cuda = TILE_CANDIDATES["cuda"]
    choice = choose_tiles(SHAPES, "cuda", fake({(Q6K, cuda[16][1]): 0.5}))
    record = choice.as_dict()
    assert record["backend"] == "cuda" and not record["errors"]
    assert record["tiles"]["Q6_K rows <= 16"] == "16x64 on 4 warps"
    assert record["tiles"]["Q4_K rows <= 16"] == "16x64 on 4 warps, <= 120 registers"
    assert set(record["ms"]["Q4_K rows more"]) == {
        "64x128 on 4 warps", "32x64 on 4 warps", "32x64 on 4 warps, <= 168 registers"}
    hip = choose_tiles(SHAPES, "hip", fake({})).as_dict()
    assert hip["tiles"]["Q4_K rows <= 16"] == "16x32 on 4 warps, 1 stage"


@pytest.mark.gpu
def test_every_candidate_builds_and_runs_on_the_gpu():
    """The real measure: every candidate of every bound times (finite, no error) on small
    Q4_K and Q6_K shapes, and the choice is applied."""
    import torch

    from engine.tile_tune import gpu_tile_measure

    device = torch.device("cuda")
    backend = "hip" if torch.version.hip else "cuda"
    shapes = [LinearShape(Q4K, 256, 512, 2), LinearShape(Q6K, 128, 512, 1)]
    choice = choose_tiles(shapes, backend, gpu_tile_measure(device))
    assert not choice.errors, choice.errors
    for times in choice.ms.values():
        assert all(0 < ms < math.inf for ms in times.values()), times
    apply_tiles(choice)
    for (held, bound), tile in choice.tiles.items():
        assert tiled_tile(bound if bound < 1 << 62 else 512, backend, held) == tile


def test_a_choice_is_kept_and_a_later_load_takes_it_without_timing(tmp_path):
    cache = tmp_path / "sub" / "q8_tiles.json"
    cuda = TILE_CANDIDATES["cuda"]
    calls: list = []
    costs = {(Q4K, cuda[16][1]): 0.5, (Q6K, cuda[64][1]): 0.7}
    bad = cuda[32][1]
    first = tuned_choice(SHAPES, "cuda", "H200", fake(costs, calls, fail=bad), cache)
    assert calls and not first.cached and cache.exists()
    timed = len(calls)
    again = tuned_choice(SHAPES, "cuda", "H200", fake(costs, calls, fail=bad), cache)
    assert len(calls) == timed and again.cached  # nothing timed the second time
    assert again.tiles == first.tiles and again.errors == first.errors
    assert again.ms == first.ms and again.ms[int(T.Q4_K), 32][bad] == math.inf
    assert again.as_dict()["cached"] and not first.as_dict()["cached"]
    # another device or other shapes: timed anew, both kept
    other = tuned_choice(SHAPES[:2], "cuda", "MI300X", fake({}, calls), cache)
    assert len(calls) > timed and not other.cached
    assert tuned_choice(SHAPES, "cuda", "H200", fake({}, calls), cache).cached
    keys = {cache_key(SHAPES, "cuda", "H200"), cache_key(SHAPES[:2], "cuda", "MI300X")}
    assert set(json.loads(cache.read_text())) == keys
    # no file: always timed
    before = len(calls)
    assert not tuned_choice(SHAPES, "cuda", "H200", fake({}, calls), None).cached
    assert len(calls) > before


def test_bounds_the_gluon_kernel_takes_are_not_timed_and_keep_their_default(tmp_path,
                                                                            monkeypatch):
    """On NVIDIA with Gluon the 16-, 32- and 64-row bounds of both types run
    kernels/qint_mma.py (16 alone with MBUFO_QINT_MMA_ROWS=16), so no tile of them is
    timed or applied; the record says so, the cache keeps it, and the key tells such a
    choice from one that timed every bound (MBUFO_QINT_MMA=0, HIP)."""
    import torch

    cuda = torch.device("cuda")
    assert gluon_bounds({int(T.Q4_K), Q6_K_A}, "cuda", cuda) == {
        (t, b) for t in (int(T.Q4_K), Q6_K_A) for b in (16, 32, 64)}
    monkeypatch.setenv("MBUFO_QINT_MMA_ROWS", "16")
    skip = gluon_bounds({int(T.Q4_K), Q6_K_A}, "cuda", cuda)
    assert skip == {(int(T.Q4_K), 16), (Q6_K_A, 16)}
    assert gluon_bounds({int(T.Q4_K)}, "hip", cuda) == frozenset()
    monkeypatch.setenv("MBUFO_QINT_MMA", "0")
    assert gluon_bounds({int(T.Q4_K)}, "cuda", cuda) == frozenset()
    monkeypatch.delenv("MBUFO_QINT_MMA")
    calls = []
    fast16 = TILE_CANDIDATES["cuda"][16][1]
    cache = tmp_path / "q8_tiles.json"
    choice = tuned_choice(SHAPES, "cuda", "H200", fake({(Q4K, fast16): 0.5}, calls), cache,
                          skip)
    assert calls and all(m != 16 for *_, m in calls)
    assert not set(choice.tiles) & skip and set(choice.skipped) == skip
    assert choice.as_dict()["skipped"] == ["Q4_K rows <= 16", "Q6_K rows <= 16"]
    apply_tiles(choice)
    assert not any(bound == 16 for _, _, bound in TUNED_TILES)
    again = tuned_choice(SHAPES, "cuda", "H200", fake({}, calls), cache, skip)
    assert again.cached and set(again.skipped) == skip
    assert cache_key(SHAPES, "cuda", "H200", skip) != cache_key(SHAPES, "cuda", "H200")


def test_a_bad_cache_file_is_a_miss_and_an_unwritable_one_is_no_error(tmp_path, caplog):
    cache = tmp_path / "q8_tiles.json"
    key = cache_key(SHAPES, "cuda", "H200")
    for text in ("{not json", "[1, 2]", json.dumps({key: {"backend": "cuda"}}),
                 # a tile that is no candidate (a hand-edited or foreign file)
                 json.dumps({key: {"backend": "cuda", "tiles": [[Q4K, 16, [8, 8, 1]]],
                                   "ms": [], "errors": {}}})):
        cache.write_text(text)
        assert read_cached(cache, key) is None
        choice = tuned_choice(SHAPES, "cuda", "H200", fake({}), cache)
        assert not choice.cached and read_cached(cache, key) is not None  # rewritten whole
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with caplog.at_level("WARNING"):
        choice = tuned_choice(SHAPES, "cuda", "H200", fake({}), blocked / "q8_tiles.json")
    assert not choice.cached and "not written" in caplog.text
    # no temporary file left (the lock file stays, as flock wants)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "q8_tiles.json",
                                                           "q8_tiles.json.lock"]


def test_a_record_written_meanwhile_by_another_process_is_kept(tmp_path):
    """Two loads timing at once (the server and `mbufo inspect`, say): the one that writes
    last keeps the other's record, written while it was timing, and the writes are
    serialized by the file's lock."""
    import multiprocessing

    cache = tmp_path / "q8_tiles.json"
    measure = fake({})

    def timing_while_another_writes(tile, ggml_type, n, k, m):
        if not cache.exists():  # the first candidate: another process tunes and writes
            ctx = multiprocessing.get_context("spawn")
            proc = ctx.Process(target=_tune_elsewhere, args=(str(cache),))
            proc.start()
            proc.join(60)
            assert proc.exitcode == 0
        return measure(tile, ggml_type, n, k, m)

    tuned_choice(SHAPES, "cuda", "H200", timing_while_another_writes, cache)
    assert set(json.loads(cache.read_text())) == {cache_key(SHAPES, "cuda", "H200"),
                                                  cache_key(SHAPES, "cuda", "MI300X")}
    assert tuned_choice(SHAPES, "cuda", "MI300X", fake({}, calls := []), cache).cached
    assert not calls


def _tune_elsewhere(path: str) -> None:
    """Another process's load: tunes for another device and writes the same file."""
    from pathlib import Path

    tuned_choice(SHAPES, "cuda", "MI300X", fake({}), Path(path))


def test_the_cache_path_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("MBUFO_TILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path() == tmp_path / "mbufo" / "q8_tiles.json"
    monkeypatch.setenv("MBUFO_TILE_CACHE", str(tmp_path / "t.json"))
    assert cache_path("auto") == tmp_path / "t.json"
    monkeypatch.setenv("MBUFO_TILE_CACHE", "off")
    assert cache_path() is None
    assert cache_path(None) is None and cache_path("off") is None
    assert cache_path(tmp_path / "x.json") == tmp_path / "x.json"


def test_the_cache_keeps_the_newest_records(tmp_path, monkeypatch):
    import engine.tile_tune as tile_tune

    monkeypatch.setattr(tile_tune, "CACHE_ENTRIES", 3)
    cache = tmp_path / "q8_tiles.json"
    for name in "abcde":
        tuned_choice(SHAPES, "cuda", name, fake({}), cache)
    assert list(json.loads(cache.read_text())) == [cache_key(SHAPES, "cuda", n) for n in "cde"]
