"""MBUFO_CARVEOUT (kernels/triton_util.py): the setting's checks, which kernels take it, and
a kernel's shared memory read from the metadata file Triton keeps beside its binary."""

from __future__ import annotations

import json

import pytest

from kernels.triton_util import SMALL_SHARED, _kernel_shared, carveout_for, carveout_setting


@pytest.mark.parametrize("raw,want", [(None, None), ("", None), ("  ", None), ("0", 0),
                                      ("15", 15), (" 29 ", 29), ("100", 100)])
def test_setting(raw, want):
    assert carveout_setting(raw) == want


@pytest.mark.parametrize("raw", ["-1", "101", "15%", "1.5", "max"])
def test_bad_setting_is_a_clear_error(raw):
    with pytest.raises(ValueError, match="MBUFO_CARVEOUT must be a whole percentage"):
        carveout_setting(raw)


def test_only_kernels_of_little_shared_memory_take_it():
    assert carveout_for(0, 15) == 15
    assert carveout_for(SMALL_SHARED, 15) == 15
    assert carveout_for(SMALL_SHARED + 1, 15) is None  # Triton's own preference stays
    assert carveout_for(1024, None) is None
    assert carveout_for(1024, 0) == 0


def test_shared_memory_from_the_metadata_file(tmp_path):
    meta = tmp_path / "k.json"
    meta.write_text(json.dumps({"shared": 16384, "num_warps": 4}))
    assert _kernel_shared({"k.cubin": str(tmp_path / "k.cubin"), "k.json": str(meta)}) == 16384
    # unknown: counted as the most, so the kernel keeps its own preference
    assert carveout_for(_kernel_shared({}), 15) is None
    assert carveout_for(_kernel_shared({"k.json": str(tmp_path / "missing.json")}), 15) is None
    meta.write_text("{}")
    assert carveout_for(_kernel_shared({"k.json": str(meta)}), 15) is None
