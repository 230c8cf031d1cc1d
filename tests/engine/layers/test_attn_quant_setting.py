"""MBUFO_ATTN_QUANT (engine/layers/attention.py): off unless 1; a clear error otherwise."""

from __future__ import annotations

import pytest

from engine.layers.attention import attn_quant_enabled


@pytest.mark.parametrize("raw,want", [(None, False), ("", False), ("0", False), ("1", True),
                                      (" 1 ", True)])
def test_setting(monkeypatch, raw, want):
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
