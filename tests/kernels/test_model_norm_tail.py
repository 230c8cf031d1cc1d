"""MBUFO_NORM_TAIL and MBUFO_ACT_TAIL in a decoder step (the interpreter, a tiny synthetic
Llama on the q8 layout's Triton path, one row): the o and down products' launches add
their output to the residual stream and normalize it, so only the first layer's norm runs
as a kernel of its own, and the logits stay those of the step with the norm kernels; the
gate|up launches write the activation, and the logits keep their bits."""

from __future__ import annotations

import torch


def step_with_tails(path: str) -> dict:
    """In the interpreter's worker: one single-token prefill step, its logits and the norm
    kernel launches with MBUFO_NORM_TAIL=1, 2 and 0 (the same batch and KV)."""
    import os

    from tiny_q8 import tiny_core

    from engine.kernel_select import set_mode
    from engine.models import common
    from engine.sampler import SamplingParams
    from engine.scheduler.request import Request

    set_mode("triton")
    before = os.environ.get("MBUFO_NORM_TAIL")
    try:
        core, model, vocab = tiny_core(path)
        out = {}
        plain, calls, step = common.add_rms_norm, [0, 0], model.step_logits
        plain_act = common.gated_act_quant

        def counted(*args, **kwargs):
            calls[0] += 1
            return plain(*args, **kwargs)

        def counted_act(*args, **kwargs):
            calls[1] += 1
            return plain_act(*args, **kwargs)

        def both(batch, kv):
            common.add_rms_norm, common.gated_act_quant = counted, counted_act
            try:
                for flag, act in (("1", "0"), ("2", "0"), ("0", "1"), ("0", "0")):
                    os.environ["MBUFO_NORM_TAIL"], os.environ["MBUFO_ACT_TAIL"] = flag, act
                    calls[:] = [0, 0]
                    name = flag if act == "0" else "act"
                    out[name] = step(batch, kv)
                    out[name + "_norms"], out[name + "_acts"] = calls
            finally:
                common.add_rms_norm, common.gated_act_quant = plain, plain_act
                os.environ.pop("MBUFO_ACT_TAIL")
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
    from tiny_q8 import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=5)
    got = interp.call("test_model_norm_tail:step_with_tails", str(path))
    assert got["0_norms"] == 2 * got["layers"] + 1
    assert got["0_acts"] == got["layers"] and got["1_acts"] == got["layers"]
    # MBUFO_ACT_TAIL: the gate|up launches write the activation, with the kernel's bits
    assert got["act_acts"] == 0 and got["act_norms"] == got["0_norms"]
    assert torch.equal(got["act"], got["0"])
    kernels = got["0"]
    scale = kernels.abs().max()
    for flag in ("1", "2"):  # the first layer's norm only, after the embedding
        assert got[flag + "_norms"] == 1, flag
        with_tails = got[flag]
        assert with_tails.shape == kernels.shape and not torch.isnan(with_tails).any()
        # the same logits up to the norm's sum of squares taken in another order (an
        # 8-bit code may round the other way)
        assert (with_tails - kernels).abs().max() <= 2e-3 * scale, float(
            (with_tails - kernels).abs().max() / scale)
