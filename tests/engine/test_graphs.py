"""Decode-graph bookkeeping on the CPU, with a fake capture that runs the captured function
eagerly: bucket choice, static buffers and padding (padding rows write K/V only to the
scratch page, which the pool never hands out), capture once per bucket, eager fallback for
mixed steps. Logits are checked against a runner without graphs on the same tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from graph_fakes import FakeCapture
from span_batch import span_batch

from engine.batch import ForwardBatch
from engine.graphs import BUCKETS, DecodeGraphs, bucket_for, buckets_up_to, is_decode_only
from engine.kv.pool import SeqPages
from engine.layers.attention import (
    PlannedBatch,
    _decode_plan,
    attn_config,
    decode_items_host,
    plan_decode,
)
from engine.loader import load
from engine.runner import ModelRunner
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

PAGES, CONTEXT = 24, 96


@pytest.fixture(scope="module")
def model(tmp_path_factory, vocab_dir):
    # gemma3 with a window: a full and a sliding group, so two page tables per row
    spec = SyntheticSpec("gemma3", num_layers=6, hidden_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=32, ffn_size=128, sliding_window=24, default_type=T.F32)
    path = tmp_path_factory.mktemp("graphs") / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=3)
    return load(path, torch.float32, "cpu").model


def planes(runner: ModelRunner) -> list[torch.Tensor]:
    return [p.clone() for side in (runner.kv.k, runner.kv.v) for layer in side
            for p in layer.values()]


def step(runners, seqs, spans):
    """One forward on each runner; spans: per row (sequence index, new token ids)."""
    out = []
    for runner, pages in zip(runners, seqs, strict=True):
        out.append(runner.forward(span_batch(runner, pages, spans)))
    return out


def test_buckets_and_decode_only():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_for(65) is None
    tables = {"full": [[0], [1]]}
    assert is_decode_only(ForwardBatch.build([([5], 3), ([6], 0)], tables))
    assert not is_decode_only(ForwardBatch.build([([5, 6], 3), ([6], 0)], tables))
    assert not is_decode_only(ForwardBatch.build([([5], 3), ([6], 0)], tables, [1]))


def test_buckets_reach_the_configured_rows():
    assert buckets_up_to(1) == buckets_up_to(64) == BUCKETS
    assert buckets_up_to(65) == BUCKETS + (128,)
    assert buckets_up_to(200) == BUCKETS + (128, 256)
    assert bucket_for(100, buckets_up_to(100)) == 128


def test_more_sessions_than_64_replay_their_full_decode_steps(model):
    """A runner set up for 70 decode rows has a 128-row bucket: a 70-row decode step
    replays a graph (58 padding rows) and agrees with the runner without graphs."""
    fake = FakeCapture()
    rows = 70
    graphed = ModelRunner(model, 2 * rows, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                          capture=fake, max_rows=rows)
    plain = ModelRunner(model, 2 * rows, 16, "f16", max_context=CONTEXT)
    assert graphed.graphs.buckets == BUCKETS + (128,)
    assert ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                       capture=FakeCapture()).graphs.buckets == BUCKETS
    runners = (graphed, plain)
    seqs = [[SeqPages(r.pool) for _ in range(rows)] for r in runners]
    a, b = step(runners, seqs, [(i, [10 + i % 7, 3]) for i in range(rows)])  # prefill: eager
    assert fake.captures == 0
    ids = a.argmax(-1).tolist()
    a, b = step(runners, seqs, [(i, [ids[i]]) for i in range(rows)])
    assert fake.captures == 1 and graphed.graphs.captured == (128,)
    assert graphed.graphs.num_replays == 1 and a.shape == b.shape == (rows, model.cfg.vocab_size)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_graph_path_matches_eager_and_pads_into_scratch(model):
    warmed = []
    fake = FakeCapture(on_warmed=lambda: warmed.append(planes(graphed)))
    graphed = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                          capture=fake)
    plain = ModelRunner(model, PAGES, 16, "f16", max_context=CONTEXT)
    assert plain.graphs is None and graphed.graphs is not None
    scratch = graphed.graphs.scratch_pages
    assert scratch == {"full": PAGES, "sliding": PAGES}  # one page past the pool's own
    runners = (graphed, plain)
    seqs = [[SeqPages(r.pool) for _ in range(5)] for r in runners]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (n,), generator=gen).tolist() for n in (5, 30, 11, 17, 2)]
    a, b = step(runners, seqs, [(i, p) for i, p in enumerate(prompts[:4])])  # mixed: eager
    assert fake.captures == 0 and torch.equal(a, b)
    before = planes(graphed)
    for rows in (4, 4, 3):  # bucket 4, then 3 rows and one padding row
        ids = a.argmax(-1).tolist()
        a, b = step(runners, seqs, [(i, [ids[i]]) for i in range(rows)])
        assert a.shape == b.shape == (rows, model.cfg.vocab_size)
        if rows == 4:  # the same shapes as eager: the same numbers
            assert torch.equal(a, b)
        else:  # CPU matmuls round a row differently with 3 or 4 rows
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert fake.captures == 1 and graphed.graphs.captured == (4,)
    assert graphed.graphs.num_replays == 3
    # The warm-ups before the capture wrote K/V into the scratch pages only.
    ps = graphed.page_size
    for old, new in zip(before, warmed[0], strict=True):
        assert torch.equal(old[:PAGES * ps], new[:PAGES * ps])
        assert new[PAGES * ps].abs().sum() > 0
    # The real rows' K/V agree with the runner without graphs (its pool has no scratch).
    for old, new in zip(planes(plain), planes(graphed), strict=True):
        torch.testing.assert_close(new[:PAGES * ps].float(), old.float(), rtol=1e-3, atol=1e-3)
    owned = {p for s in seqs[0] for g in ("full", "sliding") for p in s.table(g)}
    assert PAGES not in owned


def test_long_rows_take_longer_splits_in_decode_and_mixed_steps(model, monkeypatch):
    """A long row is cut into at most MAX_DECODE_SPLITS splits (longer keys a split, its
    plan covering every key) in a decode step and, as plan_attention cuts it, in a mixed
    step (there as a decode step cuts it, given its split: decode_keys): the plans' most
    splits hold both."""
    import kernels.paged_attention_plan as plan

    monkeypatch.setattr(plan, "MAX_DECODE_SPLITS", 1)
    runner = ModelRunner(model, PAGES, 16, "f16", max_context=PAGES * 16, num_sms=132)
    keys = {g: int(t[300]) for g, t in runner._keys_by_len.items()}
    assert keys == {"full": 512, "sliding": 256}  # 300 keys; the window's 24
    # (a window's keys may straddle two splits)
    assert runner._splits_for(300) == {"full": 1, "sliding": 2}  # mixed steps' too
    assert runner._max_splits == {"full": 1, "sliding": 2}
    # two programs a multiprocessor over the KV heads: what a step's plan_attention fills
    assert runner._fill == {g: 264 // layer.num_kv_heads for g, layer in runner._layers.items()}
    assert set(ModelRunner(model, PAGES, 16, "f16")._fill.values()) == {0}  # the CPU: none
    monkeypatch.setenv("MBUFO_PREFILL_CUT", "0")  # off for A/B runs
    assert set(ModelRunner(model, PAGES, 16, "f16", num_sms=132)._fill.values()) == {0}
    monkeypatch.setenv("MBUFO_PREFILL_CUT", "yes")
    with pytest.raises(ValueError, match="MBUFO_PREFILL_CUT"):
        ModelRunner(model, PAGES, 16, "f16", num_sms=132)
    items = decode_items_host(np.array([300]), None, keys["full"], 1)
    assert items[:, 3].min() == 0 and items[:, 4].max() == 300  # every key, one split
    layer = runner._layers["full"]
    mixed = plan.plan_attention(torch.tensor([0, 1, 3]), torch.tensor([300, 40]),
                                group=layer.num_heads // layer.num_kv_heads, window=None,
                                config=attn_config(layer, torch.device("cpu")), device="cpu",
                                decode_splits=runner._splits_for(300)["full"])
    assert mixed.work[:2, 3:5].tolist() == [[0, 300], [0, 40]]  # one split a row
    # cut as a decode step cuts it, the one-token row's items run apart (decode_work)
    mixed = plan.plan_attention(torch.tensor([0, 1, 3]), torch.tensor([300, 40]),
                                group=layer.num_heads // layer.num_kv_heads, window=None,
                                config=attn_config(layer, torch.device("cpu")), device="cpu",
                                decode_splits=runner._splits_for(300)["full"],
                                decode_keys=[keys["full"], keys["full"]])
    assert mixed.decode_work[:, 3:5].tolist() == [[0, 300]]
    assert mixed.work[:, 3:5].tolist() == [[0, 40]]


def test_other_buckets_and_fallbacks(model):
    fake = FakeCapture()
    graphed = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                          capture=fake)
    plain = ModelRunner(model, PAGES, 16, "f16", max_context=CONTEXT)
    runners = (graphed, plain)
    seqs = [[SeqPages(r.pool) for _ in range(5)] for r in runners]
    a, b = step(runners, seqs, [(i, [10 + i] * (i + 2)) for i in range(5)])
    for spans, bucket in (([(0, [7])], 1), ([(i, [8]) for i in range(5)], 8),
                          ([(1, [9]), (3, [9])], 2)):
        a, b = step(runners, seqs, spans)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert bucket in graphed.graphs.captured
    replays = graphed.graphs.num_replays
    a, b = step(runners, seqs, [(0, [5]), (1, [5, 6])])  # mixed step: eager
    assert torch.equal(a, b)
    assert graphed.graphs.num_replays == replays and fake.captures == 3
    long = SeqPages(graphed.pool)  # past max_context: eager, whatever the row count
    long.ensure(CONTEXT + 1)
    batch = ForwardBatch.build([([4], CONTEXT)], {g: [long.table(g)] for g in graphed.pool.groups})
    assert not graphed.graphs.fits(batch)


def test_static_buffers_padding_and_keys():
    """A fake step that returns its static inputs: what a captured forward would read."""
    seen = []

    def fake_step(batch: ForwardBatch, splits):
        seen.append(dict(splits))
        cols = [batch.input_ids, batch.positions, batch.seq_lens, batch.logits_rows]
        return torch.stack(cols + [t[:, 0] for t in batch.page_tables.values()], 1).float()

    graphs = DecodeGraphs(fake_step, ["full", "sliding"], {"full": 40, "sliding": 50},
                          page_size=16, max_context=64, device=torch.device("cpu"),
                          capture=FakeCapture())
    batch = ForwardBatch.build([([11], 20), ([12], 3), ([13], 33)],
                               {"full": [[1, 2], [3], [4, 5, 6]],
                                "sliding": [[-1, 7], [8], [-1, -1, 9]]})
    out = graphs.run(batch, {"full": 1, "sliding": 1})
    assert out.tolist() == [[11, 20, 21, 0, 1, -1], [12, 3, 4, 1, 3, 8], [13, 33, 34, 2, 4, -1]]
    static = graphs.static_batch(4)
    assert static.input_ids[3] == 0 and static.positions[3] == 0 and static.seq_lens[3] == 1
    assert static.page_tables["full"][3].tolist() == [40, -1, -1, -1]
    assert static.page_tables["sliding"][3].tolist() == [50, -1, -1, -1]
    assert static.page_tables["full"][1].tolist() == [3, -1, -1, -1]  # stale columns cleared
    graphs.run(batch, {"full": 2, "sliding": 1})  # more key splits: another graph
    graphs.run(batch, {"full": 1, "sliding": 1})
    assert graphs.num_graphs == 2 and graphs.captured == (4,) and graphs.num_replays == 3
    assert {"full": 2, "sliding": 1} in seen and seen[-1] == {"full": 1, "sliding": 1}
    too_wide = ForwardBatch.build([([1], 70)], {"full": [[0] * 5], "sliding": [[0] * 5]})
    assert not graphs.fits(too_wide)  # 5 pages > max_context 64 / 16


@pytest.mark.parametrize("window", [None, 40])
def test_host_items_are_plan_decodes(window):
    """decode_items_host (numpy) gives _decode_plan's (torch) work items, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    lens = torch.cat([torch.tensor([1, 2, 255, 256, 257, 512, 1000]),
                      torch.randint(1, 3000, (20,), generator=gen)])
    for splits in (1, 2, 4, 16):
        want = _decode_plan(lens, window, 256, splits,
                            torch.arange(len(lens), dtype=torch.int32)).work
        got = decode_items_host(lens.numpy(), window, 256, splits)
        assert got.dtype == np.int32 and np.array_equal(got, want.numpy()), splits


def test_staged_plans_are_plan_decodes(model):
    """With DecodePlans (the runner's), a decode graph's step receives a PlannedBatch whose
    plans, tables, positions and write slots, staged on the host and uploaded with the rows,
    equal what plan_decode makes on the device from the same rows, padding included."""
    runner = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=640,
                         capture=FakeCapture())
    graphs, seen = runner.graphs, []
    assert graphs.plans.max_splits == {"full": 3, "sliding": 2}
    graphs.step = lambda batch, splits: seen.append((batch, dict(splits))) or torch.zeros(1)
    batch = ForwardBatch.build([([11], 20), ([12], 3), ([13], 90)],
                               {"full": [[1, 2], [3], [4, 5, 6, 7, 8, 9]],
                                "sliding": [[-1, 7], [8], [-1, -1, -1, -1, 9, 10]]})
    for splits in ({"full": 1, "sliding": 1}, {"full": 2, "sliding": 2}):
        graphs.run(batch, splits)
        planned, used = seen[-1]
        assert isinstance(planned, PlannedBatch) and used == splits
        plain = ForwardBatch(planned.input_ids, planned.positions, planned.query_start,
                             planned.seq_lens, planned.page_tables, planned.logits_rows)
        want = plan_decode(plain, runner._layers, 16, splits)
        for g in ("full", "sliding"):
            a, b = planned.attn[g], want.attn[g]
            assert a.plan.num_slots == b.plan.num_slots == 4 * splits[g]
            assert a.plan.num_tokens == b.plan.num_tokens == 4
            for x, y in ((a.plan.work, b.plan.work), (a.plan.tok_base, b.plan.tok_base),
                         (a.plan.tok_splits, b.plan.tok_splits), (a.page_table, b.page_table),
                         (a.positions, b.positions),
                         (planned.write_slots(g, 16), want.write_slots(g, 16))):
                assert x.dtype == y.dtype and torch.equal(x, y), g
            assert a.config == b.config
        assert planned.write_slots("full", 16)[3] == PAGES * 16  # the padding row's scratch


def test_prepare_and_a_failed_capture(model):
    fake = FakeCapture()
    runner = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                         capture=fake)
    assert runner.prepare_graphs() == 7 and runner.graphs.captured == (1, 2, 4, 8, 16, 32, 64)

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    failing = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                          capture=broken)
    plain = ModelRunner(model, PAGES, 16, "f16", max_context=CONTEXT)
    seqs = [[SeqPages(r.pool)] for r in (failing, plain)]
    step((failing, plain), seqs, [(0, [3, 4, 5])])
    a, b = step((failing, plain), seqs, [(0, [6])])  # the capture fails: eager, graphs off
    assert failing.graphs is None and torch.equal(a, b)


def test_graphs_prepared_to_a_context_serve_its_rows_without_a_capture(model):
    """prepare_graphs(context) captures every key split count that rows of up to `context`
    tokens take; a decode step at any length then replays (a capture while serving would
    stall every stream's step)."""
    fake = FakeCapture()
    context = 1500
    runner = ModelRunner(model, 300, 16, "f16", cuda_graphs=True, max_context=context,
                         capture=fake)
    held = runner.prepare_graphs(context)
    splits = {s["full"] for s in runner._splits_up_to(context)}
    assert len(splits) > 2 and held == fake.captures  # several split counts, all captured
    seqs = [SeqPages(runner.pool) for _ in range(3)]
    for length in (1, 300, 700, context - 1):  # rows across the split counts
        spans = [(i, [5] * (length - seqs[i].num_tokens)) for i in range(3)]
        runner.forward(span_batch(runner, seqs, spans))  # prefill (eager) to `length`
        runner.forward(span_batch(runner, seqs, [(i, [7]) for i in range(3)]))
        assert runner.last_replayed and fake.captures == held, length


def test_a_step_says_whether_it_captured_its_graph(model):
    """last_captured: the step that captures a decode graph (a stall the engine reports in
    its slow steps), not the replays after it nor eager steps."""
    fake = FakeCapture()
    runner = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                         capture=fake)
    seqs = [SeqPages(runner.pool) for _ in range(2)]
    flags = []
    for spans in ([(0, [3, 4, 5]), (1, [6, 7])], [(0, [8]), (1, [9])], [(0, [1]), (1, [2])]):
        runner.forward(span_batch(runner, seqs, spans))
        flags.append((runner.last_replayed, runner.last_captured))
    assert flags == [(False, False), (True, True), (True, False)] and fake.captures == 1


def test_build_core_warms_up_to_its_context(tmp_path, vocab_dir, monkeypatch):
    """build_core hands warm-up the sessions' context (capped at the model's), so the
    decode graphs of long rows are captured at load, not while serving."""
    import engine.build as build

    spec = SyntheticSpec("llama", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=16, ffn_size=64, default_type=T.F32)
    path = tmp_path / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=4)
    loaded = load(path, torch.float32, "cpu")
    calls, wants = [], build.wants_warm_up
    monkeypatch.setattr(build, "wants_warm_up", lambda opts, runner: True)
    monkeypatch.setattr(ModelRunner, "warm_up",
                        lambda self, chunk=48, context=1: calls.append((chunk, context)) or 0.0)
    build.build_core(loaded, build.EngineOptions(sessions=2, context=3000, prefill_chunk=64,
                                                 device="cpu"))
    cap = loaded.config.context_length
    build.build_core(loaded, build.EngineOptions(sessions=2, context=cap + 100,
                                                 prefill_chunk=64, device="cpu"))
    assert calls == [(64, min(3000, cap)), (64, cap)]
    assert not wants(build.EngineOptions(), ModelRunner(
        loaded.model, 8, 16, "f16", cuda_graphs=True, max_context=64))  # the CPU: never


def _free_pages(runner: ModelRunner) -> dict[str, int]:
    return {g: p.num_free for g, p in runner.pool.groups.items()}


def _record_warm_up(runner, monkeypatch):
    seen, captured = [], []
    runner.triton = True  # as on a GPU; the forwards themselves are recorded, not run
    monkeypatch.setattr(runner, "forward_eager", lambda b: seen.append(
        (b.num_rows, b.num_tokens, b.positions[:2].tolist(), b.max_seq_len())))
    monkeypatch.setattr(runner, "prepare_graphs", lambda context=1: captured.append(context))
    return seen, captured


def test_warm_up_runs_each_step_class_and_gives_its_pages_back(model, monkeypatch):
    runner = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                         capture=FakeCapture())
    assert runner.warm_up() == 0.0  # the CPU path builds nothing
    free = _free_pages(runner)
    seen, captured = _record_warm_up(runner, monkeypatch)
    assert runner.warm_up(chunk=40, context=7) >= 0.0
    # chunks of 48 (a multiple of 16, qmatmul's tiled path), 33 and 47 tokens, from 0 or
    # after 48 tokens, alone and beside 1, 15 and 16 decode rows: rows 1, 2, 16, 17 and
    # token counts a multiple of 16 or not
    # then WARM_UP_MIXED as far as 24 pages a group hold them: 15 decode rows beside 64
    # tokens (79 rows: past the 64-row tiles), one decode row of the longest context (96
    # tokens here: the key split's 513 is past it) beside 15 tokens
    assert seen == [(1, 48, [0, 1], 48), (1, 33, [48, 49], 81), (2, 34, [0, 1], 33),
                    (2, 48, [48, 49], 95), (16, 48, [0, 1], 33), (16, 49, [48, 49], 82),
                    (17, 49, [0, 1], 33), (16, 79, [0, 1], 64), (2, 16, [0, 1], 96)]
    rows = {r for r, *_ in seen}
    assert {r % 16 == 0 for r in rows} == {True, False} and 1 in rows
    assert {t % 16 == 0 for _, t, *_ in seen} == {True, False}
    assert captured == [7]
    assert _free_pages(runner) == free


def test_warm_up_with_too_few_pages_skips_shapes_and_loses_none(model, monkeypatch, caplog):
    runner = ModelRunner(model, 6, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                         capture=FakeCapture())
    free = _free_pages(runner)
    seen, captured = _record_warm_up(runner, monkeypatch)
    runner.warm_up(chunk=40)
    # with 6 pages per group, a 95-token chunk beside a decoder and 16 or more sequences
    # do not fit; the other shapes still run
    assert seen == [(1, 48, [0, 1], 48), (1, 33, [48, 49], 81), (2, 34, [0, 1], 33)]
    assert "warm-up skipped" in caplog.text
    assert captured == [1]  # the graphs are still captured
    assert _free_pages(runner) == free


def test_warm_up_batches_run_through_the_model(model, monkeypatch):
    """Each warm-up step is a valid batch for the model's forward (here the CPU path's,
    standing in for the kernels'): logits for every row, and the pool unchanged."""
    runner = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                         capture=FakeCapture())
    free = _free_pages(runner)
    real = runner.forward_eager
    shapes = []

    def cpu_forward(batch):
        runner.triton = False
        try:
            logits = real(batch)
        finally:
            runner.triton = True
        assert logits.shape[0] == batch.num_rows and torch.isfinite(logits).all()
        shapes.append(batch.num_rows)
        return logits

    runner.triton = True
    monkeypatch.setattr(runner, "forward_eager", cpu_forward)
    monkeypatch.setattr(runner, "prepare_graphs", lambda context=1: 0)
    runner.warm_up(chunk=40)
    assert shapes == [1, 1, 2, 2, 16, 16, 17, 16, 2]
    assert _free_pages(runner) == free


def test_warm_up_mixed_steps_reach_key_splits(model, monkeypatch):
    """With pages enough, every WARM_UP_MIXED shape runs: 79 and 176 rows (the matrix
    kernels' classes past 64 rows), and decode rows one token past two key splits
    (attention's partials and merge), 16 of them and one."""
    from kernels.paged_attention_plan import SPLIT_KEYS

    runner = ModelRunner(model, 700, 16, "f16", cuda_graphs=True, max_context=1024,
                         capture=FakeCapture())
    free = _free_pages(runner)
    seen, _ = _record_warm_up(runner, monkeypatch)
    runner.warm_up(chunk=40)
    long = 2 * SPLIT_KEYS + 1
    assert seen[7:] == [(16, 79, [0, 1], 64), (17, 176, [0, 1], 160),
                        (17, 32, [0, 1], long), (2, 16, [0, 1], long)]
    assert _free_pages(runner) == free


def test_warm_up_pdl_pass_runs_only_what_a_mixed_graph_holds(model, monkeypatch):
    """Where launches can be programmatic dependent ones, the shapes a mixed graph holds
    (tokens and decode rows within its largest bucket) run a second time as such, and no
    chunk larger than that (eager steps launch without PDL); without mixed graphs, none."""
    from types import MethodType, SimpleNamespace

    from engine import runner as runner_mod
    from engine.mixed_graphs import TOKEN_BUCKETS, MixedGraphs
    from kernels import triton_util

    runner = ModelRunner(model, 700, 16, "f16", cuda_graphs=True, max_context=1024,
                         capture=FakeCapture())
    # the mixed graphs' sizes as the Triton path builds them (the CPU path has none)
    runner.mixed = SimpleNamespace(buckets=TOKEN_BUCKETS, max_rows=runner.graphs.buckets[-1])
    runner.mixed.holds = MethodType(MixedGraphs.holds, runner.mixed)
    free = _free_pages(runner)
    seen, _ = _record_warm_up(runner, monkeypatch)
    pdl = []
    eager = runner.forward_eager
    monkeypatch.setattr(runner, "forward_eager", lambda b: (
        pdl.append(getattr(triton_util._PDL_EAGER, "on", False)), eager(b)))
    monkeypatch.setattr(runner_mod, "pdl_enabled", lambda device: True)
    runner.warm_up(chunk=400)
    first = [s for s, on in zip(seen, pdl, strict=True) if not on]
    second = [s for s, on in zip(seen, pdl, strict=True) if on]
    assert len(first) == len(runner_mod.WARM_UP_SHAPES) + len(runner_mod.WARM_UP_MIXED)
    assert second == [s for s in first if s[1] <= TOKEN_BUCKETS[-1]]  # (rows, tokens..)
    assert second == first[-len(runner_mod.WARM_UP_MIXED):]  # the 400-token chunks left
    assert _free_pages(runner) == free
    runner.mixed = None
    seen.clear()
    pdl.clear()
    runner.warm_up(chunk=400)
    assert seen and not any(pdl)


def test_a_dropped_runner_frees_its_graphs_without_a_collection(model):
    """The graphs' step functions hold the model, not the runner: dropping a runner frees
    it (and its graphs' CUDA resources, on a GPU) at once, never later in a collection that
    could run while another graph captures."""
    import gc
    import weakref

    runner = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                         capture=FakeCapture())
    seqs = [SeqPages(runner.pool) for _ in range(2)]
    runner.forward(span_batch(runner, seqs, [(0, [5]), (1, [6])]))  # a decode graph
    assert runner.graphs.num_graphs == 1
    del seqs
    gc.disable()
    try:
        dropped = weakref.ref(runner)
        del runner
        assert dropped() is None
    finally:
        gc.enable()


def test_no_collection_holds_the_collector_off():
    import gc

    from engine.graphs import no_collection

    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left as it was
    finally:
        gc.enable()


def test_warm_up_of_a_hybrid_model_runs_its_shapes_on_the_blocks_first(model, monkeypatch):
    """With dense copies (the hybrid layout) every shape runs twice: on the blocks (as the
    q8 layout's would, building the kernels of every row class) and then as served."""
    from engine.layers import ggml_linear

    runner = ModelRunner(model, PAGES, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                         capture=FakeCapture())
    assert not runner._has_dense()
    seen, _ = _record_warm_up(runner, monkeypatch)
    runner.warm_up(chunk=40)
    plain = list(seen)
    seen.clear()
    modes = []
    monkeypatch.setattr(runner, "_has_dense", lambda: True)
    monkeypatch.setattr(runner, "forward_eager", lambda b: (
        seen.append((b.num_rows, b.num_tokens)),
        modes.append(getattr(ggml_linear._LOCAL, "blocks_only", False))))
    runner.warm_up(chunk=40)
    shapes = [(r, t) for r, t, *_ in plain]
    assert seen == shapes + shapes
    assert modes == [True] * len(shapes) + [False] * len(shapes)
    assert not getattr(ggml_linear._LOCAL, "blocks_only", False)
