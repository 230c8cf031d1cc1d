"""MBUFO_CARVEOUT (kernels/triton_util.py): the setting's checks, which kernels take it and
how much (never fewer resident programs than all of the shared memory would hold), and a
kernel's shared memory read from the metadata file Triton keeps beside its binary."""

from __future__ import annotations

import json

import pytest

from kernels.triton_util import (
    SHARED_RESERVED,
    SMALL_SHARED,
    SMLimits,
    _kernel_meta,
    carveout_for,
    carveout_kernels,
    carveout_setting,
    resident_programs,
    takes_carveout,
)


@pytest.mark.parametrize("raw,want", [(None, 15), ("", 15), ("  ", 15), ("off", None),
                                      (" OFF ", None),
                                      ("0", 0), ("15", 15), (" 29 ", 29), ("100", 100)])
def test_setting(raw, want):
    assert carveout_setting(raw) == want


@pytest.mark.parametrize("raw", ["-1", "101", "15%", "1.5", "max"])
def test_bad_setting_is_a_clear_error(raw):
    with pytest.raises(ValueError, match="MBUFO_CARVEOUT must be off or a whole percentage"):
        carveout_setting(raw)


def test_only_kernels_of_little_shared_memory_take_it():
    assert carveout_for(0, 15) == 15
    assert carveout_for(SMALL_SHARED + 1, 15) is None  # Triton's own preference stays
    assert carveout_for(1024, None) is None
    # 8 programs of 4 warps at 64 registers: 8 x 2 KB fit in 7% of 228 KB
    assert carveout_for(1024, 0, regs=64) == 8
    assert carveout_for(1024, 15, regs=64) == 15


H200 = SMLimits()


@pytest.mark.parametrize("regs,warps,shared,want", [
    (64, 4, 0, 8),        # registers: 65536 / (64 x 128)
    (32, 4, 0, 16),       # warps: 64 / 4
    (32, 1, 0, 32),       # program slots
    (162, 4, 0, 3),       # 168 a thread as allocated (256 a warp): 65536 / (168 x 128)
    (32, 4, 40 * 1024, 5),  # shared memory: 228 KB / 41 KB
    (255, 8, 0, 1),
])
def test_resident_programs(regs, warps, shared, want):
    assert resident_programs(regs, warps, shared, H200) == want


def test_the_carveout_keeps_every_resident_program():
    """A carveout below what a kernel's resident programs need would hold fewer of them
    (16 streams lost 17% with 15% for every kernel): it is raised to their need, and a
    setting above that stays."""
    for regs, warps, shared in [(32, 4, 0), (64, 4, 16 * 1024), (128, 4, 40 * 1024),
                                (32, 4, SMALL_SHARED), (255, 8, 1024), (96, 2, 8 * 1024)]:
        programs = resident_programs(regs, warps, shared, H200)
        for percent in (0, 8, 15, 29, 100):
            value = carveout_for(shared, percent, regs, warps, H200)
            assert percent <= value <= 100
            assert value * H200.shared / 100 >= programs * (shared + SHARED_RESERVED)
            if value > percent:  # raised no further than the need
                assert (value - 1) * H200.shared / 100 < programs * (shared + SHARED_RESERVED)
    # 5 programs of 40 KB (41 with the reserved KB): 205 KB, 90% of 228
    assert carveout_for(40 * 1024, 15, 32, 4, H200) == 90


def test_shared_memory_from_the_metadata_file(tmp_path):
    meta = tmp_path / "k.json"
    meta.write_text(json.dumps({"shared": 16384, "num_warps": 4}))
    assert _kernel_meta({"k.cubin": str(tmp_path / "k.cubin"), "k.json": str(meta)})[0] == 16384
    meta.write_text(json.dumps({"shared": 0, "num_warps": 8}))
    assert _kernel_meta({"k.json": str(meta)}) == (0, 8)
    # unknown: counted as the most, so the kernel keeps its own preference
    assert carveout_for(_kernel_meta({})[0], 15) is None
    assert carveout_for(_kernel_meta({"k.json": str(tmp_path / "missing.json")})[0], 15) is None
    meta.write_text("{}")
    assert carveout_for(_kernel_meta({"k.json": str(meta)})[0], 15) is None


DEFAULT = {"_qint_gemv_kernel", "_attn_partial_kernel", "_attn_merge_kernel"}


@pytest.mark.parametrize("raw,want", [
    (None, DEFAULT), ("", DEFAULT), (" , ", DEFAULT), ("all", None), (" ALL ", None),
    ("_qint_gemv_kernel", {"_qint_gemv_kernel"}),
    (" _qint_gemv_kernel, _attn_partial_kernel ,", {"_qint_gemv_kernel", "_attn_partial_kernel"}),
])
def test_kernels_that_take_the_carveout(raw, want):
    got = carveout_kernels(raw)
    assert got == (None if want is None else frozenset(want))
    for name in ("_qint_gemv_kernel", "_attn_partial_kernel", "_add_rms_norm_kernel"):
        assert takes_carveout(name, got) == (want is None or name in want)


@pytest.mark.parametrize("raw", ["qint_gemv", "_qint_gemv_kernel;_x_kernel", "_a kernel"])
def test_a_bad_kernel_name_is_a_clear_error(raw):
    with pytest.raises(ValueError, match="MBUFO_CARVEOUT_KERNELS"):
        carveout_kernels(raw)
