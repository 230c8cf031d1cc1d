"""A decoder step on the q8 layout's Triton path (the interpreter, on a tiny synthetic
Llama whose head keeps 256 rows): the output norm's kernel quantizes its output for the
head, which then launches no quantization of its own, with the bits of the head quantizing
for itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

T = __import__("gguf").GGMLQuantizationType


def step_both_ways(path: str, attn_quant: bool = False) -> dict:
    """In the interpreter's worker: one prefill step of the tiny model, its logits by
    step_logits and by logits(forward()), and how many x quantization launches each took
    (`attn_quant`: with MBUFO_ATTN_QUANT=1, the attention quantizing for the o product)."""
    import os

    before = os.environ.get("MBUFO_ATTN_QUANT")
    os.environ["MBUFO_ATTN_QUANT"] = "1" if attn_quant else "0"
    try:
        return _step_both_ways(path)
    finally:  # the worker serves other tests
        if before is None:
            os.environ.pop("MBUFO_ATTN_QUANT")
        else:
            os.environ["MBUFO_ATTN_QUANT"] = before


def _step_both_ways(path: str) -> dict:
    from engine.build import EngineOptions, build_core, load_for
    from engine.kernel_select import set_mode
    from engine.sampler import SamplingParams
    from engine.scheduler.request import Request
    from kernels import qint

    set_mode("triton")
    try:
        opts = EngineOptions(sessions=1, context=64, prefill_chunk=16, device="cpu",
                             dtype="f32", weights="q8", cuda_graphs=False,
                             max_pending_per_client=None)
        core = build_core(load_for(Path(path), opts), opts)
        model, out = core.runner.model, {}
        from engine.layers import ggml_linear

        # the head's first 256 rows only: the vocabulary's 128256 take minutes interpreted
        part, vocab = model.head.parts[0], model.head.out_features
        model.head = ggml_linear.GGMLLinear(
            [ggml_linear.GGMLPart(256, part.ggml_type, part.weight[:256].clone())],
            model.head.in_features, act8=model.head.act8)

        calls = [0]
        plain = qint.quantize_x

        def counted(x):
            calls[0] += 1
            return plain(x)

        fused = model.step_logits

        def both(batch, kv):
            ggml_linear.quantize_x = qint.quantize_x = counted
            try:
                calls[0] = 0
                out["fused"], out["fused_launches"] = fused(batch, kv), calls[0]
                calls[0] = 0
                out["apart"] = model.logits(model.forward(batch, kv))
                out["apart_launches"] = calls[0]
            finally:
                ggml_linear.quantize_x = qint.quantize_x = plain
            # the sampler's vocabulary: the rows past the head's 256 never drawn
            return torch.nn.functional.pad(out["fused"], (0, vocab - 256), value=-1e30)

        model.step_logits = both
        core.add(Request("r", (5, 6),
                         SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)))
        core.step()
        out["layers"] = len(model.blocks)
        out["head_takes_xq"] = bool(getattr(model.head, "takes_xq", False))
        return out
    finally:
        set_mode(None)


@pytest.mark.parametrize("attn_quant", [False, True])
def test_output_norm_quantizes_for_the_head(interp, tmp_path, vocab_dir, attn_quant):
    from engine.synthetic import SyntheticSpec, write_synthetic_gguf

    q4 = {name: T.Q4_K for name in ("attn_q.weight", "attn_k.weight", "attn_output.weight",
                                     "ffn_gate.weight", "ffn_up.weight", "token_embd.weight")}
    spec = SyntheticSpec("llama", hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=64,
                         ffn_size=512, num_layers=2,
                         types={**q4, "attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K,
                                "output.weight": T.Q6_K})
    path = tmp_path / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=3)
    got = interp.call("test_model_q8_head:step_both_ways", str(path), attn_quant)
    assert got["head_takes_xq"]
    # one a layer for the o projection, none with MBUFO_ATTN_QUANT (the attention quantizes
    # for it: f16 KV, 4 query heads of 64 columns a KV head); the head's own only apart
    layers = 0 if attn_quant else got["layers"]
    assert got["fused_launches"] == layers
    assert got["apart_launches"] == layers + 1
    assert got["fused"].shape[-1] == got["apart"].shape[-1] > 0
    assert not torch.isnan(got["fused"]).any()
    assert torch.equal(got["fused"], got["apart"])


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
