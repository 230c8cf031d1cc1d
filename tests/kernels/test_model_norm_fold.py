"""A decoder step on the q8 layout's Triton path with MBUFO_NORM_FOLD (the
interpreter, on the tiny synthetic Llama of tiny_q8): the norms before q|k|v and gate|up
are folded (their scale applied by the rope and activation kernels), the output norm is
not, and the logits are the unfolded step's up to rounding."""

from __future__ import annotations

import pytest
import torch


def step_with_and_without_fold(path: str, prompt: tuple[int, ...]) -> dict:
    """In the interpreter's worker: the logits of the step that prefills `prompt`, folded
    and not, and the norm launches each took."""
    import os

    from tiny_q8 import tiny_core

    from engine.kernel_select import set_mode
    from engine.models import common
    from engine.sampler import SamplingParams
    from engine.scheduler.request import Request

    set_mode("triton")
    before = os.environ.get("MBUFO_NORM_FOLD")
    try:
        core, model, vocab = tiny_core(path)
        out, calls = {}, {"folded": 0, "plain": 0}
        plain_norm, folded_norm = common.add_rms_norm, common.add_norm_folded

        def count(name, fn):
            def counted(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return counted

        step = model.step_logits

        def both(batch, kv):
            common.add_rms_norm = count("plain", plain_norm)
            common.add_norm_folded = count("folded", folded_norm)
            try:
                for setting in ("0", "1"):
                    os.environ["MBUFO_NORM_FOLD"] = setting
                    calls.update(folded=0, plain=0)
                    out[setting] = step(batch, kv)
                    out[f"calls_{setting}"] = dict(calls)
                # the sums 4x: the scale the rope and activation kernels apply halves
                common.add_norm_folded = lambda *a, **k: (lambda n, s: (n, s * 4))(
                    *folded_norm(*a, **k))
                out["sums_x4"] = step(batch, kv)
            finally:
                common.add_rms_norm, common.add_norm_folded = plain_norm, folded_norm
            return torch.nn.functional.pad(out["1"], (0, vocab - 256), value=-1e30)

        model.step_logits = both
        core.add(Request("r", prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                   ignore_eos=True)))
        core.step()
        out["layers"] = len(model.blocks)
        return out
    finally:
        set_mode(None)
        if before is None:
            os.environ.pop("MBUFO_NORM_FOLD", None)
        else:
            os.environ["MBUFO_NORM_FOLD"] = before


@pytest.mark.parametrize("prompt", [(7,), (5, 6, 7)])  # one row (decode-like), three
def test_folded_step_matches_the_plain_step(interp, tmp_path, vocab_dir, prompt):
    from tiny_q8 import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=5)
    out = interp.call("test_model_norm_fold:step_with_and_without_fold", str(path), prompt)
    layers = out["layers"]
    assert out["calls_0"] == {"folded": 0, "plain": 2 * layers + 1}
    assert out["calls_1"] == {"folded": 2 * layers, "plain": 1}  # the output norm's
    plain, folded = out["0"].double(), out["1"].double()
    assert torch.isfinite(folded).all() and plain.shape == folded.shape == (1, 256)
    err = float((folded - plain).abs().max() / plain.abs().max())
    assert err < 2e-2, err  # int8 codes of h * w instead of the norm's: rounding only
    assert int(folded.argmax()) == int(plain.argmax())
    # the folded kernels take their scale from the sums: a wrong scale shows
    off = float((out["sums_x4"].double() - plain).abs().max() / plain.abs().max())
    assert off > 10 * max(err, 1e-3), (off, err)
