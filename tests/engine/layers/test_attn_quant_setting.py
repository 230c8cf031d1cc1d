"""MBUFO_ATTN_QUANT (engine/layers/attention.py): 0 or 1, unset following MBUFO_CARVEOUT (on
by default) at one row on NVIDIA; a clear error otherwise."""

from __future__ import annotations

import pytest

from engine.layers.attention import attn_quant_enabled


@pytest.mark.parametrize("raw,want", [(None, False), ("", False), ("0", False), ("1", True),
                                      (" 1 ", True)])
def test_setting(monkeypatch, raw, want):
    """Set, it decides; unset, nothing on the CPU."""
    if raw is None:
        monkeypatch.delenv("MBUFO_ATTN_QUANT", raising=False)
    else:
        monkeypatch.setenv("MBUFO_ATTN_QUANT", raw)
    assert attn_quant_enabled() is want


@pytest.mark.parametrize("raw", ["yes", "2", "true"])
def test_bad_setting_is_a_clear_error(monkeypatch, raw):
    monkeypatch.setenv("MBUFO_ATTN_QUANT", raw)
    with pytest.raises(ValueError, match="MBUFO_ATTN_QUANT must be 0 or 1"):
        attn_quant_enabled()


@pytest.mark.parametrize("carveout,tokens,want", [
    (None, 1, True), ("off", 1, False), ("15", 1, True), ("15", 2, False), ("8", 16, False),
    (None, 2, False)])
def test_unset_follows_the_carveout_at_one_row(monkeypatch, carveout, tokens, want):
    """Unset: on at one row on NVIDIA where the carveout is on (by default; without it the
    o product right after the attention runs 18% slower), never on ROCm (no carveout)."""
    import torch

    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.delenv("MBUFO_ATTN_QUANT", raising=False)
    monkeypatch.delenv("MBUFO_CARVEOUT", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attn_quant_enabled(1) is False
    monkeypatch.setattr(torch.version, "hip", None)

    monkeypatch.delenv("MBUFO_ATTN_QUANT", raising=False)
    if carveout is None:
        monkeypatch.delenv("MBUFO_CARVEOUT", raising=False)
    else:
        monkeypatch.setenv("MBUFO_CARVEOUT", carveout)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert attn_quant_enabled(tokens) is want
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU: never
    assert attn_quant_enabled(tokens) is False
    monkeypatch.setenv("MBUFO_ATTN_QUANT", "1")
    assert attn_quant_enabled(tokens) is True
