"""MBUFO_MIXED_CAPTURE_AT: when a mixed step's graph is captured (A/B runs of the capture's
stall against the launches its replays save), checked on a runner of the Triton path."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from engine.mixed_graphs import CAPTURE_AT, capture_at_setting


def mixed_capture_at(path: str, setting: str | None) -> int | None:
    """In the worker: the runner's mixed graphs' capture_at with the setting (None: unset)."""
    import os

    import torch
    from graph_fakes import FakeCapture

    from engine.loader import load
    from engine.runner import ModelRunner

    saved = os.environ.pop("MBUFO_MIXED_CAPTURE_AT", None)
    if setting is not None:
        os.environ["MBUFO_MIXED_CAPTURE_AT"] = setting
    try:
        model = load(path, torch.float32, "cpu").model
        runner = ModelRunner(model, 8, 16, "f16", cuda_graphs=True, max_context=64,
                             capture=FakeCapture())
        return None if runner.mixed is None else runner.mixed.capture_at
    finally:
        os.environ.pop("MBUFO_MIXED_CAPTURE_AT", None)
        if saved is not None:
            os.environ["MBUFO_MIXED_CAPTURE_AT"] = saved


def test_setting_parses(monkeypatch):
    monkeypatch.delenv("MBUFO_MIXED_CAPTURE_AT", raising=False)
    assert capture_at_setting() == CAPTURE_AT == 2
    for raw, want in (("1", 1), (" 8 ", 8), ("off", None)):
        monkeypatch.setenv("MBUFO_MIXED_CAPTURE_AT", raw)
        assert capture_at_setting() == want
    for raw in ("0", "-1", "two", "1.5", "on"):
        monkeypatch.setenv("MBUFO_MIXED_CAPTURE_AT", raw)
        with pytest.raises(ValueError, match="MBUFO_MIXED_CAPTURE_AT"):
            capture_at_setting()


def test_runner_takes_the_setting(triton_worker, tmp_path, vocab_dir):
    from engine.synthetic import SyntheticSpec, write_synthetic_gguf

    spec = SyntheticSpec("llama", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=16, ffn_size=64, default_type=T.F32)
    path = tmp_path / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
    call = "test_mixed_capture_setting:mixed_capture_at"
    assert triton_worker.call(call, str(path), None) == CAPTURE_AT
    assert triton_worker.call(call, str(path), "6") == 6
    assert triton_worker.call(call, str(path), "off") is None  # mixed steps run eagerly
