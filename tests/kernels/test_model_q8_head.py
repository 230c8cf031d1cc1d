"""A decoder step on the q8 layout's Triton path (the interpreter, on a tiny synthetic
Llama whose head keeps 256 rows): the output norm's kernel quantizes its output for the
head, which then launches no quantization of its own, with the bits of the head quantizing
for itself."""

from __future__ import annotations

import pytest
import torch


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
    from tiny_q8 import tiny_core

    from engine.kernel_select import set_mode
    from engine.layers import ggml_linear
    from engine.sampler import SamplingParams
    from engine.scheduler.request import Request
    from kernels import quant_x

    set_mode("triton")
    try:
        core, model, vocab = tiny_core(path)
        out = {}
        calls = [0]
        plain = quant_x.quantize_x

        def counted(x):
            calls[0] += 1
            return plain(x)

        fused = model.step_logits

        def both(batch, kv):
            ggml_linear.quantize_x = quant_x.quantize_x = counted
            try:
                calls[0] = 0
                out["fused"], out["fused_launches"] = fused(batch, kv), calls[0]
                calls[0] = 0
                out["apart"] = model.logits(model.forward(batch, kv))
                out["apart_launches"] = calls[0]
            finally:
                ggml_linear.quantize_x = quant_x.quantize_x = plain
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
    from tiny_q8 import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=3)
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
