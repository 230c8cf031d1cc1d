"""Mixed-step graphs end to end on the Triton path (interpreted on the CPU, in the worker
with MBUFO_KERNELS=triton): a runner whose steps replay captured graphs (a fake capture
that runs the captured function) against one that runs every step eagerly, on the q8
layout of a tiny model whose block products (qint) give a row the same bits at any token
count; each step asks for 4 logits rows, a power of two, so the dense head multiplies as
many rows on both sides. Prefill-only, decode-only and mixed steps, one-token rows with
several key splits (32 keys a split here), a replayed key, a step past the largest
bucket, and a chunk whose query blocks are cut into key splits (runners that fill 132
multiprocessors, 32 keys a cut split at least): every logit bit-equal, the K/V of real
slots bit-equal, padding written only to the scratch pages. Keys are captured in their
step, or (`idle`) after it, as the engine loop does when it has no request: those
captures' runs must leave every real slot's K/V as it was."""

from __future__ import annotations

import pytest
import torch
from graph_fakes import FakeCapture
from q8_llama import random_ids, write_q8_llama
from span_batch import span_batch

from engine.build import EngineOptions, load_for
from engine.kv.pool import SeqPages
from engine.layers.attention import plan_batch
from engine.runner import ModelRunner

PAGES, CONTEXT = 24, 256


def planes(runner: ModelRunner) -> list[torch.Tensor]:
    return [p.clone() for side in (runner.kv.k, runner.kv.v) for layer in side
            for p in layer.values()]


def graph_against_eager(path: str, steps: list, num_sms: int = 0, when: str = "step") -> dict:
    """In the worker: the same steps on a runner with graphs and one without, both for
    `num_sms` multiprocessors (the worker is shared: its split sizes are put back after)."""
    import kernels.paged_attention_plan as plan_module

    saved = plan_module.SPLIT_KEYS, plan_module.MIN_PREFILL_SPLIT
    plan_module.SPLIT_KEYS = plan_module.MIN_PREFILL_SPLIT = 32  # several splits here
    try:
        return _steps_on_both(path, steps, num_sms, when)
    finally:
        plan_module.SPLIT_KEYS, plan_module.MIN_PREFILL_SPLIT = saved


def _steps_on_both(path: str, steps: list, num_sms: int, when: str) -> dict:
    model = load_for(path, EngineOptions(device="cpu", dtype="f32", weights="q8")).model
    fake = FakeCapture()
    graphed = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                          capture=fake, num_sms=num_sms)
    assert graphed.mixed is not None
    graphed.mixed.buckets = (16, 32, 64)
    graphed.mixed.capture_at = 1  # every key at first sight
    graphed.mixed.when = when
    plain = ModelRunner(model, PAGES, 16, "f16", max_context=CONTEXT, num_sms=num_sms)
    seqs = {id(r): [SeqPages(r.pool) for _ in range(5)] for r in (graphed, plain)}
    out, slots = [], []
    for spans in steps:
        batch = span_batch(graphed, seqs[id(graphed)], spans)
        got = graphed.forward(batch)
        replayed, mixed_graphs = graphed.last_replayed, graphed.mixed.num_graphs
        want = plain.forward(span_batch(plain, seqs[id(plain)], spans))
        out.append((got, want, replayed, mixed_graphs, fake.captures))
        while graphed.idle():  # when="idle": the due key's capture, between steps
            pass
        planned = plan_batch(batch, batch, graphed._layers, 16, graphed._fill)
        slots.append(planned.attn["full"].plan.num_slots)  # the eager plan's, made alike
    return {"steps": out, "graphed": planes(graphed), "plain": planes(plain),
            "mixed_replays": graphed.mixed.num_replays, "real": PAGES * 16, "slots": slots}


@pytest.mark.parametrize(("num_sms", "when"), [(0, "step"), (132, "step"), (0, "idle")])
def test_mixed_steps_replay_the_eager_bits(triton_worker, tmp_path, vocab_dir, num_sms, when):
    path = write_q8_llama(tmp_path / "q8.gguf", vocab_dir, num_layers=2, seed=17)
    ids = random_ids()

    steps = [
        [(0, ids(40)), (1, ids(9)), (2, ids(3)), (4, ids(5))],  # prefill only: bucket 64
        [(0, ids(1)), (1, ids(1)), (2, ids(1)), (4, ids(1))],  # decode only: decode graphs
        [(0, ids(1)), (1, ids(1)), (3, ids(20)), (2, ids(1))],  # mixed; row 0: 2 splits
        [(0, ids(1)), (1, ids(1)), (3, ids(20)), (2, ids(1))],  # the same key: a replay
        [(0, ids(1)), (3, ids(70)), (1, ids(1)), (2, ids(1))],  # 73 tokens: eager
        [(0, ids(1)), (3, ids(40)), (1, ids(1)), (2, ids(1))],  # 40 at 110: bucket 64 again
    ]
    res = triton_worker.call("test_mixed_graph_steps:graph_against_eager", str(path), steps,
                             num_sms, when)
    flags = [(replayed, graphs) for _, _, replayed, graphs, _ in res["steps"]]
    # the last step is bucket 64's, but a key of its own: its one-token rows' items run
    # apart (the first step had none), and cut, its chunk's splits take more slots too
    if when == "step":
        assert flags == [(True, 1), (True, 1), (True, 2), (True, 2), (False, 2), (True, 3)]
        assert res["mixed_replays"] == 4 and res["steps"][-1][4] == 4  # + 1 decode
    else:  # a key's first step runs eagerly, its capture follows it
        assert flags == [(False, 0), (True, 1), (False, 1), (True, 2), (False, 2), (False, 2)]
        assert res["mixed_replays"] == 1 and res["steps"][-1][4] == 3
    # the last step's slots: row 0's 2 key splits (46 keys), rows 1 and 2 one each, the
    # chunk's 40 tokens one each uncut; cut (132 items to fill, 32 keys at least), each of
    # its query blocks' keys (to 142 and 150) in 2 splits or more
    assert res["slots"][-1] == 44 if num_sms == 0 else res["slots"][-1] >= 2 + 1 + 1 + 80
    for got, want, *_ in res["steps"]:
        assert torch.isfinite(want).all() and torch.equal(got, want)
    real = res["real"]
    for a, b in zip(res["graphed"], res["plain"], strict=True):
        assert torch.equal(a[:real], b[:real])  # the real slots: the same K/V
    assert any(p[real:].ne(0).any() for p in res["graphed"])  # padding went to scratch
