"""bench/gpu/pad_kernels.py (engine_bench's `+padN`): the variant names it reads, and the
empty kernels it launches after each of the decoder's fused norms, then takes away."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import pad_kernels  # noqa: E402

import engine.models.common as common  # noqa: E402


@pytest.mark.parametrize("name,count", [("q8+graphs+pad2", 2), ("q8+pad1+graphs", 1),
                                        ("q8+graphs", 0), ("pad3+graphs", 0),
                                        ("q8+graphs+padx", 0), ("q8+pad12", 12)])
def test_pad_count(name, count):
    assert pad_kernels.pad_count(name) == count


def test_padded_norms_launch_after_each_norm_and_restore(monkeypatch):
    launches = []

    class Recorder:
        def __init__(self, kernel, device):
            self.kernel, self.device = kernel, device

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, self.device, grid))

    monkeypatch.setattr(pad_kernels, "launcher", Recorder)
    original = common.add_rms_norm
    x, w = torch.randn(3, 64), torch.rand(64) + 0.5
    with pad_kernels.padded_norms(2):
        assert common.add_rms_norm is not original
        got = common.add_rms_norm(x, w, 1e-6, torch.randn(3, 64) * 0, None)
    assert common.add_rms_norm is original
    want = original(x, w, 1e-6, torch.zeros(3, 64), None)
    assert torch.equal(got.h, want.h) and torch.equal(got.y, want.y)
    assert [(d, g) for _, d, g in launches] == [(x.device, (1,))] * 2
    with pad_kernels.padded_norms(0):
        assert common.add_rms_norm is original
