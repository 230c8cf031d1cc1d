"""gpt-oss's config (sliding layers, YaRN, experts) read from its keys, bad files named, and
YaRN's cos/sin against ggml's formula in float64. Its logits against llama.cpp:
test_family_parity.py; its CPU layouts: test_moe_files.py."""

from __future__ import annotations

import math

import gguf
import pytest
import torch

from engine.errors import GGUFFormatError
from engine.gguf import ModelFile
from engine.inspect import inspect_model
from engine.layers.rope import Rope
from engine.llm import LLM
from engine.models.config import YaRN
from engine.models.registry import read_config
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

T = gguf.GGMLQuantizationType
BASE = dict(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, ffn_size=128,
            num_layers=3, num_experts=4, experts_used=2, expert_ffn_size=64, sliding_window=8,
            tied_embeddings=False, types={"ffn_gate_exps.weight": T.MXFP4,
                                          "ffn_up_exps.weight": T.MXFP4,
                                          "ffn_down_exps.weight": T.MXFP4})


def write(tmp_path, vocab_dir, name: str, edit=None, **spec) -> str:
    """A tiny gpt-oss file; `edit(writer)` adds keys before the vocabulary is copied."""
    path = tmp_path / f"{name}.gguf"
    write_synthetic_gguf(path, SyntheticSpec("gpt-oss", **{**BASE, **spec}),
                         vocab_dir / "ggml-vocab-llama-spm.gguf", seed=4)
    if edit is not None:
        reader = gguf.GGUFReader(path)
        out = tmp_path / f"{name}-edited.gguf"
        writer = gguf.GGUFWriter(out, "gpt-oss")
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            vtype = gguf.GGUFValueType(field.types[0])
            sub = gguf.GGUFValueType(field.types[-1]) if vtype == gguf.GGUFValueType.ARRAY \
                else None
            writer.add_key_value(key, field.contents(), vtype, sub_type=sub)
        edit(writer)
        for t in reader.tensors:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape,
                              raw_dtype=gguf.GGMLQuantizationType(t.tensor_type))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        path = out
    return str(path)


def test_config_as_llama_cpp_reads_it(tmp_path, vocab_dir):
    """Layer 0 slides, then every other one; the window; YaRN's factor and context; the
    experts; the clamped SwiGLU; the MLP norm's tensor; the softmax over the picks."""
    path = write(tmp_path, vocab_dir, "cfg", num_layers=5, yarn_factor=32.0,
                 yarn_original_context=4096)
    cfg = read_config(ModelFile.open(path))
    assert cfg.swa_layers == (True, False, True, False, True)
    assert cfg.sliding_window == 8 and cfg.rope_neox
    assert cfg.rope_freq_scale == cfg.rope_freq_scale_swa == 1 / 32
    assert cfg.rope_yarn == YaRN(4096)
    assert (cfg.num_experts, cfg.experts_used, cfg.ffn_size) == (4, 2, 64)
    assert cfg.activation == "swiglu_oai" and cfg.ffn_norm_tensor == "post_attention_norm"
    assert cfg.expert_weights_norm and cfg.expert_weights_scale is None
    info = inspect_model(path)
    assert info["rope_scaling"] == {"type": "yarn", "factor": 32.0, "original_context": 4096}
    assert info["attention_sinks"] is True and info["sliding_layers"] == 3


@pytest.mark.parametrize("pattern,want", [(3, (True, True, False, True)),
                                          ([False, True], (False, True, False, False))])
def test_a_sliding_pattern_key_overrides(tmp_path, vocab_dir, pattern, want):
    """sliding_window_pattern as a period, or as a flag a layer (past the list: full)."""
    path = write(tmp_path, vocab_dir, "pattern", num_layers=4,
                 edit=lambda w: w.add_sliding_window_pattern(pattern))
    assert read_config(ModelFile.open(path)).swa_layers == want


def test_a_file_without_its_window_is_named(tmp_path, vocab_dir):
    path = write(tmp_path, vocab_dir, "nowindow", sliding_window=None)
    with pytest.raises(GGUFFormatError, match="gpt-oss.attention.sliding_window"):
        LLM(path, dtype="f32", context=64)


def ggml_yarn(positions: torch.Tensor, dims: int, base: float, factor: float,
              n_ctx_orig: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's rope_yarn (ggml-cpu/ops.cpp, ext_factor 1, attn_factor 1), in float64."""
    def corr(b: float) -> float:
        return dims * math.log(n_ctx_orig / (b * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(0, math.floor(corr(32.0))), min(dims - 1, math.ceil(corr(1.0)))
    cos, sin = [], []
    for i in range(dims // 2):
        extrap = positions.double() * base ** (-2 * i / dims)
        interp = extrap / factor
        ramp = 1 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
        theta = interp * (1 - ramp) + extrap * ramp
        mscale = 1 + 0.1 * math.log(factor)
        cos.append(theta.cos() * mscale)
        sin.append(theta.sin() * mscale)
    return torch.stack(cos, -1), torch.stack(sin, -1)


def test_yarn_cos_sin_are_ggmls():
    """gpt-oss's YaRN (factor 32 over 4096, base 150000, 64 dims) at positions up to 100K:
    within float32's rounding of the angle, which grows with the position."""
    rope = Rope(64, 150000.0, True, 1 / 32, yarn=YaRN(4096))
    pos = torch.tensor([0, 1, 7, 513, 4095, 4096, 33000, 100000])
    cos, sin = rope.cos_sin(pos)
    want_cos, want_sin = ggml_yarn(pos, 64, 150000.0, 32.0, 4096)
    tol = 1e-6 * (1 + pos.double()[:, None])
    assert ((cos.view(8, 32).double() - want_cos).abs() <= tol).all()
    assert ((sin.view(8, 32).double() - want_sin).abs() <= tol).all()
    plain = Rope(64, 150000.0, True, 1 / 32)
    assert not torch.allclose(plain.cos_sin(pos)[0], cos)  # YaRN is not linear scaling
