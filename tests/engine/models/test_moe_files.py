"""qwen3moe files that do not hold a MoE model load with an error naming what is wrong;
the CPU layouts (f32, bf16, int8) agree with each other on a good one (and on gpt-oss's)."""

from __future__ import annotations

import gguf
import pytest
import torch

from engine.errors import GGUFFormatError
from engine.llm import LLM
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

T = gguf.GGMLQuantizationType
BASE = dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, ffn_size=512,
            num_layers=1, expert_ffn_size=256,
            types={"ffn_gate_exps.weight": T.Q4_K, "ffn_up_exps.weight": T.Q4_K,
                   "ffn_down_exps.weight": T.Q6_K})


# gpt-oss's own fields: its window, an untied head; MXFP4 experts with biases
OSS = dict(sliding_window=8, tied_embeddings=False,
           types={f"ffn_{n}_exps.weight": T.MXFP4 for n in ("gate", "up", "down")})


def write(tmp_path, vocab_dir, name: str, arch: str = "qwen3moe", **spec) -> str:
    path = tmp_path / f"{name}.gguf"
    write_synthetic_gguf(path, SyntheticSpec(arch, **{**BASE, **spec}),
                         vocab_dir / "ggml-vocab-llama-spm.gguf", seed=3)
    return str(path)


@pytest.mark.parametrize("spec,message", [
    ({"num_experts": 0}, "expert_count must be a positive integer, got 0"),
    ({"num_experts": 4, "experts_used": 5}, r"expert_used_count \(5\) exceeds expert_count"),
    ({"num_experts": 4, "experts_used": 0}, "expert_used_count must be a positive integer"),
], ids=["no-experts", "more-used-than-experts", "none-used"])
def test_bad_expert_counts_are_named(tmp_path, vocab_dir, spec, message):
    path = write(tmp_path, vocab_dir, "bad", **spec)
    with pytest.raises(GGUFFormatError, match=message):
        LLM(path, dtype="f32", context=64)


def test_an_expert_tensor_of_the_wrong_shape_is_named(tmp_path, vocab_dir):
    """A file whose experts are 256 wide when its metadata says 128."""
    path = write(tmp_path, vocab_dir, "shape", num_experts=4, experts_used=2)
    data = bytearray(open(path, "rb").read())
    key = b"qwen3moe.expert_feed_forward_length"
    at = data.index(key) + len(key) + 4  # past the key and its u32 value type
    assert int.from_bytes(data[at:at + 4], "little") == 256
    data[at:at + 4] = (128).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    with pytest.raises(GGUFFormatError, match="ffn_gate_exps.weight' has shape"):
        LLM(path, dtype="f32", context=64)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_the_cpu_layouts_agree(tmp_path, vocab_dir, arch):
    """bf16 and int8 experts (gpt-oss's with their biases) against f32 on 25 tokens."""
    path = write(tmp_path, vocab_dir, "good", arch, num_experts=4, experts_used=2,
                 **(OSS if arch == "gpt-oss" else {}))
    ids = list(range(20, 45))
    f32 = LLM(path, dtype="f32", context=64).prompt_logits(ids)
    for dtype in ("bf16", "int8"):
        got = LLM(path, dtype=dtype, context=64).prompt_logits(ids)
        rel = (got - f32).norm() / f32.norm()
        assert torch.isfinite(got).all() and rel < 0.05, (dtype, float(rel))
