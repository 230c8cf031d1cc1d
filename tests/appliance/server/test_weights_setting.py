"""The `weights` setting (serve --weights, MBUFO_WEIGHTS, the TOML key): the GPU weight
layout every loaded model takes, checked at the edge; the hybrid layout's bf16 copies
counted in the memory plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as T
from server_harness import TINY_SPEC

from appliance.server.router import engine_options, planned_bytes
from appliance.settings import SettingsError, load_settings
from engine.gguf import ModelFile
from engine.planner import dense_copy_bytes
from engine.synthetic import write_synthetic_gguf


def test_weights_reach_the_engine_options_from_flag_env_and_file(tmp_path):
    assert load_settings({}, environ={}).weights == "auto"
    settings = load_settings({"weights": "hybrid"}, environ={})
    assert settings.weights == "hybrid" and engine_options(settings).weights == "hybrid"
    assert load_settings({}, environ={"MBUFO_WEIGHTS": "q8"}).weights == "q8"
    config = tmp_path / "config.toml"
    config.write_text('weights = "bf16"\n')
    assert load_settings({}, config=config, environ={}).weights == "bf16"
    assert load_settings({"weights": "ggml"}, config=config, environ={}).weights == "ggml"


def test_unknown_weights_are_refused_with_the_choices():
    with pytest.raises(SettingsError, match="weights must be one of auto, ggml, q8, bf16, "
                                            "hybrid, got q4"):
        load_settings({"weights": "q4"}, environ={})


@pytest.mark.parametrize("quantized", [True, False])
def test_hybrid_plans_its_bf16_copies_on_a_gpu(tmp_path, vocab_dir, monkeypatch, quantized):
    """The copies of the quantized linears are counted; a float file's matrices are their
    own copies (engine/layers/ggml_linear.py): nothing more."""
    spec = replace(TINY_SPEC, default_type=T.Q8_0 if quantized else T.F32)
    path = tmp_path / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=7)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    q8 = planned_bytes(str(path), engine_options(load_settings({"weights": "q8"},
                                                               environ={})))
    hybrid = planned_bytes(str(path), engine_options(load_settings(
        {"weights": "hybrid"}, environ={})))
    with ModelFile.open(path) as mf:
        copies = dense_copy_bytes(mf)
    assert hybrid == q8 + copies and (copies > 0) == quantized
