"""MBUFO_NORM_TAIL in a decoder step (the interpreter, a tiny synthetic Llama on the q8
layout's Triton path, one row): the o and down products' launches add their output to the
residual stream and normalize it, so only the first layer's norm runs as a kernel of its
own, and the logits stay those of the step with the norm kernels."""

from __future__ import annotations

from pathlib import Path

import torch

T = __import__("gguf").GGMLQuantizationType


def step_with_tails(path: str) -> dict:
    """In the interpreter's worker: one single-token prefill step, its logits and the norm
    kernel launches with MBUFO_NORM_TAIL=1 and =0 (the same batch and KV)."""
    import os

    from engine.build import EngineOptions, build_core, load_for
    from engine.kernel_select import set_mode
    from engine.models import common
    from engine.sampler import SamplingParams
    from engine.scheduler.request import Request

    set_mode("triton")
    before = os.environ.get("MBUFO_NORM_TAIL")
    try:
        opts = EngineOptions(sessions=1, context=64, prefill_chunk=16, device="cpu",
                             dtype="f32", weights="q8", cuda_graphs=False,
                             max_pending_per_client=None)
        core = build_core(load_for(Path(path), opts), opts)
        model, out = core.runner.model, {}
        from engine.layers import ggml_linear

        part, vocab = model.head.parts[0], model.head.out_features
        model.head = ggml_linear.GGMLLinear(  # 256 rows: the vocabulary takes minutes
            [ggml_linear.GGMLPart(256, part.ggml_type, part.weight[:256].clone())],
            model.head.in_features, act8=model.head.act8)
        plain, calls, step = common.add_rms_norm, [0], model.step_logits

        def counted(*args, **kwargs):
            calls[0] += 1
            return plain(*args, **kwargs)

        def both(batch, kv):
            common.add_rms_norm = counted
            try:
                for flag in ("1", "0"):
                    os.environ["MBUFO_NORM_TAIL"] = flag
                    calls[0] = 0
                    out[flag], out[flag + "_norms"] = step(batch, kv), calls[0]
            finally:
                common.add_rms_norm = plain
            return torch.nn.functional.pad(out["0"], (0, vocab - 256), value=-1e30)

        model.step_logits = both
        core.add(Request("r", (5,), SamplingParams(temperature=0.0, max_tokens=1,
                                                    ignore_eos=True)))
        core.step()
        out["layers"] = len(model.blocks)
        return out
    finally:
        set_mode(None)
        if before is None:
            os.environ.pop("MBUFO_NORM_TAIL", None)
        else:
            os.environ["MBUFO_NORM_TAIL"] = before


def test_products_take_the_norms(interp, tmp_path, vocab_dir):
    from engine.synthetic import SyntheticSpec, write_synthetic_gguf

    q4 = {name: T.Q4_K for name in ("attn_q.weight", "attn_k.weight", "attn_output.weight",
                                     "ffn_gate.weight", "ffn_up.weight", "token_embd.weight")}
    spec = SyntheticSpec("llama", hidden_size=256, num_heads=8, num_kv_heads=2, head_dim=64,
                         ffn_size=512, num_layers=2,
                         types={**q4, "attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K,
                                "output.weight": T.Q6_K})
    path = tmp_path / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=5)
    got = interp.call("test_model_norm_tail:step_with_tails", str(path))
    assert got["0_norms"] == 2 * got["layers"] + 1
    assert got["1_norms"] == 1  # the first layer's, after the embedding
    with_tails, kernels = got["1"], got["0"]
    assert with_tails.shape == kernels.shape and not torch.isnan(with_tails).any()
    # the same logits up to the norm's sum taken 256 columns at a time (an 8-bit code may
    # round the other way)
    scale = kernels.abs().max()
    assert (with_tails - kernels).abs().max() <= 2e-3 * scale, float(
        (with_tails - kernels).abs().max() / scale)
