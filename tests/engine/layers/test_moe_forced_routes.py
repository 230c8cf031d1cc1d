"""tests/engine/forced_routes.py where CI can run it: the q8 layout of a tiny gpt-oss file
on the Triton path (interpreted, in the worker) against the CPU path along the Triton
path's routing, a prefill step and teacher-forced decode steps, as test_gpu_paths'
test_gpu_logits_close_to_cpu compares them on a GPU. Every recorded block is replayed
once, in order; the logits stay within that test's q8 bound."""

from __future__ import annotations

import gguf
import pytest
import torch
from span_batch import span_batch

from engine.synthetic import SyntheticSpec, write_synthetic_gguf

T = gguf.GGMLQuantizationType
LAYERS = 3
SPEC = SyntheticSpec("gpt-oss", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                     ffn_size=256, num_layers=LAYERS, num_experts=4, experts_used=2,
                     expert_ffn_size=64, sliding_window=8, tied_embeddings=False,
                     types={"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_K,
                            "attn_v.weight": T.Q6_K, **{f"ffn_{n}_exps.weight": T.MXFP4
                                                        for n in ("gate", "up", "down")}})
MAX_REL_Q8 = 0.1  # test_gpu_paths' bound for the q8 layout


def compare(path: str, prompts: list[list[int]], steps: int) -> dict:
    """In the worker: the prompts' prefill, then `steps` decode steps on the CPU's greedy
    tokens -> each step's relative error, the routes left over after each CPU forward and
    the blocks recorded."""
    from forced_routes import ForcedRoutes

    from engine import kernel_select
    from engine.build import EngineOptions, load_for
    from engine.kv.pool import SeqPages
    from engine.runner import ModelRunner

    monkeypatch = pytest.MonkeyPatch()
    try:
        paths = {}
        for name, mode, options in (
                ("cpu", "torch", EngineOptions(device="cpu", dtype="f32", weights="bf16")),
                ("q8", "triton", EngineOptions(device="cpu", dtype="bf16", weights="q8"))):
            kernel_select.set_mode(mode)
            runner = ModelRunner(load_for(path, options).model, 32, 16, "f16",
                                 max_context=256)
            paths[name] = (mode, runner, [SeqPages(runner.pool) for _ in prompts])
        forced = ForcedRoutes(monkeypatch)
        spans = list(enumerate(prompts))
        rel, left = [], []
        for _ in range(steps + 1):
            out = {}
            for name in ("q8", "cpu"):  # the Triton path first: its routing
                mode, runner, seqs = paths[name]
                kernel_select.set_mode(mode)
                out[name] = runner.forward(span_batch(runner, seqs, spans))
            left.append(len(forced.pending))
            a, b = out["cpu"], out["q8"]
            rel.append(float((a - b).norm() / a.norm()))
            spans = [(i, [t]) for i, t in enumerate(a.argmax(-1).tolist())]
        return {"rel": rel, "left": left, "recorded": forced.num_recorded}
    finally:
        monkeypatch.undo()
        kernel_select.set_mode("triton")  # the worker's mode (conftest)


def test_the_cpu_follows_the_triton_paths_routing(triton_worker, tmp_path, vocab_dir):
    path = tmp_path / "gpt-oss.gguf"
    write_synthetic_gguf(path, SPEC, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=7)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (19, 7, 33)]
    steps = 2
    res = triton_worker.call("test_moe_forced_routes:compare", str(path), prompts, steps)
    assert res["left"] == [0] * (steps + 1)
    assert res["recorded"] == LAYERS * (steps + 1)
    assert all(r < MAX_REL_Q8 for r in res["rel"]), res["rel"]
