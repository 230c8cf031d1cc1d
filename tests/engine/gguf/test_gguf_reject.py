"""Every crafted malformed GGUF file is rejected with a typed error, in a child process bounded
to 10 s and 256 MiB, which imports engine.gguf and not torch."""

from __future__ import annotations

import pathlib
import random

import pytest
from gguf_isolation import MEMORY_LIMIT, run_isolated

from engine.bench.gguf_cases import bad_cases, expected_error, valid_file

CASES = bad_cases()

# What the message must name, by case-name prefix (the field or tensor at fault).
NAMED = {
    "key_duplicate": "'tiny.block_count'", "key_reserved": "'GGUF.version'",
    "value_type": "'x'", "string_len": "'x'", "array_len_2pow63": "'a'", "array_": "'x'",
    "nested_array": "nested arrays", "alignment_": "general.alignment",
    "n_dims": "'b.weight'", "dim": "'b.weight'", "unknown_ggml_type": "'b.weight'",
    "block_size": "'c.weight'", "offset_misaligned": "'b.weight'", "offset_": "'c.weight'",
    "size_": "'c.weight'", "tensor_name_duplicate": "'a.weight'", "version_": "version",
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, dict]]:
    root = tmp_path_factory.mktemp("bad_gguf")
    jobs = []
    for name, data in CASES:
        (root / name).write_bytes(data)
        jobs.append(f"open:{root / name}")
    (root / "valid.gguf").write_bytes(valid_file())
    header, results = run_isolated([*jobs, f"open:{root / 'valid.gguf'}"])
    by_name = {pathlib.Path(r["job"].split(":", 1)[1]).name: r for r in results}
    return header, by_name


def test_enough_distinct_cases() -> None:
    names = [n for n, _ in CASES]
    assert len(names) == len(set(names)) >= 40
    assert len({data for _, data in CASES}) == len(CASES)


def test_child_imports_no_torch_and_fits_the_cap(outcomes: tuple[dict, dict]) -> None:
    header, by_name = outcomes
    assert header["torch_imported"] is False
    assert header["vm_kib"] * 1024 < MEMORY_LIMIT
    # The cap leaves room for real work: the valid base file opens under it.
    assert by_name["valid.gguf"].get("ok") is True, by_name["valid.gguf"]
    assert by_name["valid.gguf"]["num_tensors"] == 3


@pytest.mark.parametrize("name", [n for n, _ in CASES])
def test_bad_file_rejected_with_typed_error(outcomes: tuple[dict, dict], name: str) -> None:
    res = outcomes[1][name]
    assert res.get("error") == expected_error(name).__name__, res
    assert res["message"], res
    needles = [v for k, v in NAMED.items() if name.startswith(k)]
    if needles:
        assert needles[0] in res["message"], res
    assert res["elapsed_s"] < 5.0, res


def test_cap_catches_a_big_allocation_and_the_timer_a_hang() -> None:
    _, (small, big, hang) = run_isolated(
        [f"alloc:{16 << 20}", f"alloc:{1 << 30}", "sleep:30"], time_limit_s=1.0)
    assert small.get("ok") is True and small["sum"] == 16 << 20, small
    assert big.get("error") == "MemoryError", big
    assert hang.get("error") == "Timeout" and hang["elapsed_s"] < 10, hang


def test_stock_reader_fails_on_the_files_the_guard_stops(tmp_path: pathlib.Path) -> None:
    """Why the guard exists: gguf.GGUFReader alone runs away on these (hang, memory or
    recursion); the harness reports that as something other than a typed error."""
    cases = dict(CASES)
    jobs = []
    for name in ("array_len_2pow63", "nested_array_deep"):
        (tmp_path / name).write_bytes(cases[name])
        jobs.append(f"stock:{tmp_path / name}")
    _, (loop, deep) = run_isolated(jobs, time_limit_s=1.0)
    assert loop.get("error") in {"Timeout", "MemoryError"}, loop
    assert deep.get("error") == "RecursionError", deep


def mutants(blob: bytes, count: int, seed: int = 1) -> list[bytes]:
    """`blob` with 1-3 overwrites each: a byte, or a u32/u64 set to an edge value."""
    rng = random.Random(seed)
    edges = [0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, rng.getrandbits(64)]
    out = []
    for _ in range(count):
        b = bytearray(blob)
        for _ in range(rng.randint(1, 3)):
            width = rng.choice([1, 4, 8])
            pos = rng.randrange(0, len(b) - width)
            value = rng.choice(edges) % (1 << (8 * width)) if width > 1 else rng.randrange(256)
            b[pos : pos + width] = value.to_bytes(width, "little")
        out.append(bytes(b))
    return out


def test_random_mutations_open_or_raise_typed_errors(tmp_path: pathlib.Path) -> None:
    typed = {"GGUFFormatError", "UnsupportedTensorType"}
    jobs = []
    for i, blob in enumerate(mutants(valid_file(), 200)):
        (tmp_path / f"m{i}").write_bytes(blob)
        jobs.append(f"open:{tmp_path / f'm{i}'}")
    _, results = run_isolated(jobs)
    escaped = [r for r in results if not r.get("ok") and r.get("error") not in typed]
    assert not escaped, escaped[:5]
    assert sum(1 for r in results if r.get("error") in typed) > 50  # the mutants do bite
