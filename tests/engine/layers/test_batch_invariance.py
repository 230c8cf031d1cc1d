"""DESIGN's batch invariance on the Triton path (interpreted on the CPU, in the worker with
MBUFO_KERNELS=triton): a decoding row's logits are bit-equal whether it decodes alone or
among other rows, in decode-only steps (eager and replayed from the decode graphs) and in
mixed steps beside a prompt's chunk (eager and replayed). Runners that fill 64
multiprocessors with 32 keys a split at most and 16 at least, so a row alone would cut its
keys finer than a row among 4 if the step's row count chose the cut, and a mixed step
would take other items and another kernel config than a decode-only one if its one-token
rows were planned as chunks. The model is the q8 layout of a tiny Llama (qint's products:
a row's bits at any row count) with its head run a row at a time (RowHead); f16 KV, and
k8v4 eagerly (its quantized store and the attention's rotations, kernels/rotate.py)."""

from __future__ import annotations

import pytest
import torch
from graph_fakes import FakeCapture
from q8_llama import random_ids, write_q8_llama
from span_batch import span_batch

from engine.build import EngineOptions, load_for
from engine.kv.pool import SeqPages
from engine.runner import ModelRunner

PAGES, CONTEXT = 128, 512


class RowHead:
    """The tied F32 head one row at a time: a row's logits whatever the rows beside it
    (a dense matmul's bits depend on its row count; the block heads' do not, which
    kernels' own tests show, and an interpreted Q6_K head of 32000 rows would take
    minutes)."""

    def __init__(self, head) -> None:
        self.head = head

    def __call__(self, x: torch.Tensor, xq=None) -> torch.Tensor:
        return torch.cat([self.head(x[i:i + 1]) for i in range(x.shape[0])])


def alone_and_among(path: str, steps_alone: list, steps_among: list, graphs: bool,
                    kv_quant: str = "f16") -> dict:
    """In the worker: each list of steps on a runner of its own (64 multiprocessors, the
    split sizes put back after: the worker is shared) -> every step's logits."""
    import kernels.paged_attention_plan as plan_module

    saved = plan_module.SPLIT_KEYS, plan_module.MIN_SPLIT_KEYS
    plan_module.SPLIT_KEYS, plan_module.MIN_SPLIT_KEYS = 32, 16
    try:
        model = load_for(path, EngineOptions(device="cpu", dtype="f32", weights="q8")).model
        model.head = RowHead(model.head)
        out = {}
        for name, steps in (("alone", steps_alone), ("among", steps_among)):
            fake = FakeCapture() if graphs else None
            runner = ModelRunner(model, PAGES, 16, kv_quant, cuda_graphs=graphs,
                                 max_context=CONTEXT, capture=fake, num_sms=64)
            if graphs:
                assert runner.mixed is not None
                runner.mixed.buckets = (16, 32, 64)
                runner.mixed.capture_at = 1
                runner.mixed.when = "step"
            seqs = [SeqPages(runner.pool) for _ in range(10)]
            logits, replayed = [], []
            for spans in steps:
                logits.append(runner.forward(span_batch(runner, seqs, spans)))
                replayed.append(runner.last_replayed)
            out[name] = {"logits": logits, "replayed": replayed}
        return out
    finally:
        plan_module.SPLIT_KEYS, plan_module.MIN_SPLIT_KEYS = saved


# k8v4: the quantized K/V store, the rotations of q and of the output (kernels/rotate.py)
@pytest.mark.parametrize("graphs,kv_quant", [(False, "f16"), (True, "f16"), (False, "k8v4")])
def test_a_decoding_row_has_the_same_bits_alone_and_among_others(triton_worker, tmp_path,
                                                                 vocab_dir, graphs, kv_quant):
    path = write_q8_llama(tmp_path / "q8.gguf", vocab_dir, num_layers=1, seed=23)
    ids = random_ids()

    # sequence 0 decodes; the others hold 20 to 100 tokens (1 to 4 splits of 32 keys)
    prompt = ids(60)
    others = [(i, ids(n)) for i, n in enumerate((20, 100, 45, 33), 1)]
    tokens = [ids(1) for _ in range(3)]
    chunk = ids(24)
    alone = [[(0, prompt)]] + [[(0, t)] for t in tokens]
    among = [[(0, prompt)], others]
    among += [[(0, t)] + [(i, ids(1)) for i, _ in others] for t in tokens[:2]]
    # the last token beside a prompt's chunk (a mixed step) and two decoding rows
    among += [[(1, ids(1)), (0, tokens[2]), (9, chunk), (3, ids(1))]]
    res = triton_worker.call("test_batch_invariance:alone_and_among", str(path), alone, among,
                             graphs, kv_quant)
    got, want = res["among"]["logits"], res["alone"]["logits"]
    assert torch.equal(got[0], want[0])  # the prompt, alone in both
    for step in range(2):  # decode-only steps: row 0 of 5
        assert torch.equal(got[2 + step][0], want[1 + step][0]), step
    assert torch.equal(got[4][1], want[3][0])  # the mixed step: row 1 of 4
    if graphs:  # the decode-only steps replayed; the mixed step was captured and replayed
        assert res["among"]["replayed"][2:] == [True] * 3, res["among"]["replayed"]
        assert res["alone"]["replayed"][1:] == [True] * 3, res["alone"]["replayed"]
