"""Mixed-step graph bookkeeping on the CPU (engine/mixed_graphs.py), with a fake capture and
a fake step that returns the static inputs a captured forward reads: token and row
padding (padding tokens write only the scratch page and belong to no work item), padded
key splits of one-token rows, keys, the graph limit, what falls back to eager steps, and
captures deferred to the engine's quiet moments.
The padded plan's items against kernels/paged_attention_plan.py's own."""

from __future__ import annotations

import pytest
import torch
from graph_fakes import FakeCapture

from engine.batch import ForwardBatch
from engine.errors import InvalidRequest
from engine.layers.attention import AttnLayer
from engine.mixed_graphs import MixedGraphs
from kernels.paged_attention_plan import AttnConfig, plan_attention

PAGE = 16
SCRATCH = {"full": 40, "sliding": 50}
LAYERS = {"full": AttnLayer(0, 4, 2, 32, 32, 0.1, None),
          "sliding": AttnLayer(1, 4, 2, 32, 32, 0.1, 24)}
CONFIG = AttnConfig(8, 16, 32)  # block_q 4 tokens, 32 keys a split


def make(seen: list, capture_at: int = 1, when: str = "step", **kw) -> MixedGraphs:
    def fake_step(planned):
        seen.append(planned)
        return torch.stack([planned.input_ids, planned.positions,
                            planned.write_slots("full", PAGE)], 1)[planned.logits_rows].float()

    return MixedGraphs(fake_step, LAYERS, dict.fromkeys(LAYERS, CONFIG), SCRATCH, PAGE,
                       max_context=128, max_rows=8, device=torch.device("cpu"),
                       capture=FakeCapture(), buckets=(8, 16, 32), capture_at=capture_at,
                       when=when, **kw)


def mixed_batch() -> ForwardBatch:
    """A 5-token prefill chunk at 0, decode rows at 70 and 3, a 2-token chunk at 40."""
    tables = {"full": [[1], [2, 3, 4, 5, 6], [7], [8, 9, 10]],
              "sliding": [[11], [-1, -1, -1, 12, 13], [14], [-1, 15, 16]]}
    return ForwardBatch.build([([5, 6, 7, 8, 9], 0), ([10], 70), ([11], 3), ([12, 13], 40)],
                              tables)


def test_static_inputs_are_the_batch_padded():
    seen: list = []
    graphs = make(seen)
    batch = mixed_batch()
    assert graphs.fits(batch) and not graphs.fits(ForwardBatch.build([([1], 3)], {
        "full": [[0]], "sliding": [[0]]}))  # decode-only: the decode graphs' step
    out = graphs.run(batch, {"full": 4, "sliding": 2})
    slots = batch.write_slots("full", PAGE)
    want = torch.stack([batch.input_ids, batch.positions, slots], 1)[batch.logits_rows]
    assert torch.equal(out, want.float())
    planned = seen[-1]
    assert planned.num_tokens == 16  # 9 tokens in the 16-token bucket
    assert planned.input_ids[9:].tolist() == [0] * 7 and planned.positions[9:].tolist() == [0] * 7
    for g in LAYERS:  # padding tokens write the scratch page only
        written = planned.write_slots(g, PAGE)
        assert written[:9].tolist() == batch.write_slots(g, PAGE).tolist()
        assert written[9:].tolist() == [SCRATCH[g] * PAGE] * 7
    assert planned.logits_rows.tolist() == batch.logits_rows.tolist()  # 4: a power of two
    full = planned.attn["full"].plan
    want_plan = plan_attention(batch.query_start, batch.seq_lens, group=2, window=None,
                               config=CONFIG, device="cpu", decode_splits=4)
    items = want_plan.work.shape[0]
    assert full.work.shape[0] == 16 and torch.equal(full.work[:items], want_plan.work)
    assert full.work[items:].abs().sum() == 0  # padding items: no tokens, no keys
    assert full.tok_splits[:9].tolist() == want_plan.tok_splits.tolist()
    assert full.tok_splits[9:].abs().sum() == 0  # padding tokens: no partial slots
    assert full.num_slots >= want_plan.num_slots and full.num_slots != planned.num_tokens
    assert planned.attn["full"].page_table[1, :5].tolist() == [2, 3, 4, 5, 6]
    assert planned.attn["full"].page_table[4:].eq(-1).all()  # padding rows
    assert planned.query_start[5:].tolist() == [9] * 4


def test_keys_replays_limit_and_fallbacks():
    seen: list = []
    graphs = make(seen, max_graphs=2)
    batch = mixed_batch()
    graphs.run(batch, {"full": 4, "sliding": 2})
    graphs.run(batch, {"full": 4, "sliding": 2})
    assert graphs.num_graphs == 1 and graphs._capture.captures == 1 and graphs.num_replays == 2
    graphs.run(batch, {"full": 8, "sliding": 2})  # more splits: more items, another graph
    assert graphs.num_graphs == 2
    assert graphs.run(batch, {"full": 16, "sliding": 2}) is None  # the limit: eager
    big = ForwardBatch.build([(list(range(33)), 0)], {"full": [[1, 2, 3]], "sliding": [[1, 2, 3]]})
    assert not graphs.fits(big)  # 33 tokens: past the largest bucket
    wide = ForwardBatch.build([([1, 2], 200)], {"full": [[0] * 13], "sliding": [[0] * 13]})
    assert not graphs.fits(wide)  # past max_context
    many = ForwardBatch.build([([1], i) for i in range(9)] + [([1, 2], 0)],
                              {"full": [[0]] * 10, "sliding": [[0]] * 10})
    assert not graphs.fits(many)  # 10 rows > max_rows


def test_a_key_is_captured_at_its_second_sighting():
    """A step whose key is new runs eagerly (None); the second step with that key captures
    it and replays; a third replays without a capture."""
    seen: list = []
    graphs = make(seen, capture_at=2)
    batch, splits = mixed_batch(), {"full": 4, "sliding": 2}
    assert graphs.run(batch, splits) is None
    assert graphs.num_graphs == 0 and graphs._capture.captures == 0 and not seen
    first = graphs.run(batch, splits)
    assert first is not None and graphs.num_graphs == 1 and graphs._capture.captures == 1
    assert graphs.run(batch, {"full": 8, "sliding": 2}) is None  # another key: eager first
    assert torch.equal(graphs.run(batch, splits), first)
    assert graphs._capture.captures == 1 and graphs.num_replays == 2


def test_padded_decode_splits():
    batch = mixed_batch()
    plain = plan_attention(batch.query_start, batch.seq_lens, group=2, window=None,
                           config=CONFIG, device="cpu")
    padded = plan_attention(batch.query_start, batch.seq_lens, group=2, window=None,
                            config=CONFIG, device="cpu", decode_splits=4)
    # the 2-token chunk at 40 is one query block: its 42 keys split too, unpadded
    assert padded.tok_splits.tolist() == [1] * 5 + [4, 4, 2, 2]
    rows = padded.work[:, 0].tolist()
    assert rows.count(1) == 4 and rows.count(2) == 4
    real = {tuple(w) for w in plain.work.tolist()}
    extra = [w for w in padded.work.tolist() if tuple(w) not in real]
    # row 1 (71 keys) has 3 real splits, row 2 (4 keys) one: 1 + 3 empty ones
    assert sorted((w[0], w[5]) for w in extra) == [(1, 3), (2, 1), (2, 2), (2, 3)]
    assert all(w[3] == w[4] for w in extra)
    with pytest.raises(InvalidRequest, match="decode_splits"):
        plan_attention(batch.query_start, batch.seq_lens, group=2, window=None,
                       config=CONFIG, device="cpu", decode_splits=2)


def test_long_chunks_are_cut_as_in_the_eager_plan(monkeypatch):
    """With `fill`, a long chunk's query blocks are cut into key splits in the staged plan
    exactly as plan_attention (the eager path's planner) cuts them."""
    import kernels.paged_attention_plan as plan

    monkeypatch.setattr(plan, "MIN_PREFILL_SPLIT", 16)
    seen: list = []
    fill = {"full": 8, "sliding": 8}
    graphs = make(seen, fill=fill)
    tables = {"full": [list(range(1, 8)), [8, 9]],
              "sliding": [[-1, -1, -1, -1, 10, 11, 12], [13, 14]]}
    batch = ForwardBatch.build([(list(range(9)), 100), ([3], 20)], tables)
    splits = {"full": 2, "sliding": 2}
    assert graphs.run(batch, splits) is not None
    for g, layer in LAYERS.items():
        want = plan_attention(batch.query_start, batch.seq_lens, group=2, window=layer.window,
                              config=CONFIG, device="cpu", decode_splits=splits[g],
                              fill=fill[g])
        got = seen[-1].attn[g].plan
        items = want.work.shape[0]
        assert torch.equal(got.work[:items], want.work)
        assert got.tok_splits[:10].tolist() == want.tok_splits.tolist()
        assert got.tok_base[:10].tolist() == want.tok_base.tolist()
    cut = plan_attention(batch.query_start, batch.seq_lens, group=2, window=None,
                         config=CONFIG, device="cpu", decode_splits=2, fill=8)
    assert cut.tok_splits[:9].tolist() == [2] * 9  # the chunk's blocks: two splits each


def test_a_due_key_waits_for_a_quiet_moment_and_writes_only_scratch():
    """when="idle": the step that makes a key due runs eagerly and keeps its staged inputs;
    capture_pending captures from them with every K/V write on the scratch pages (the
    capture's runs must not overwrite a sequence's K/V), one key a call; the next step
    with the key replays on its own inputs."""
    seen: list = []
    graphs = make(seen, capture_at=2, when="idle")
    batch, splits = mixed_batch(), {"full": 4, "sliding": 2}
    assert graphs.capture_pending() is False  # nothing due
    assert graphs.run(batch, splits) is None and graphs.run(batch, splits) is None
    assert graphs.num_pending == 1 and graphs._capture.captures == 0 and not seen
    assert graphs.run(batch, splits) is None and graphs.num_pending == 1  # kept once
    other = ForwardBatch.build([([5, 6, 7], 8), ([10], 30)],
                               {"full": [[1], [2, 3]], "sliding": [[1], [2, 3]]})
    graphs.run(other, splits)
    graphs.run(other, splits)
    assert graphs.num_pending == 2
    assert graphs.capture_pending() is True  # the oldest due key, alone
    assert graphs.num_graphs == 1 and graphs.num_pending == 1 and len(seen) == 2
    for planned in seen:  # the capture's runs: the due step's inputs, K/V to scratch
        assert planned.input_ids[:9].tolist() == batch.input_ids.tolist()
        for g in LAYERS:
            assert planned.write_slots(g, PAGE).tolist() == [SCRATCH[g] * PAGE] * 16
    out = graphs.run(batch, splits)  # replays, on this step's own slots
    want = torch.stack([batch.input_ids, batch.positions, batch.write_slots("full", PAGE)], 1)
    assert torch.equal(out, want[batch.logits_rows].float())
    assert graphs._capture.captures == 1 and graphs.num_replays == 1
    assert graphs.capture_pending() is True and graphs.capture_pending() is False
    assert graphs.num_graphs == 2 and graphs.num_pending == 0


def test_pending_keys_are_bounded(monkeypatch):
    import engine.mixed_graphs as mixed

    monkeypatch.setattr(mixed, "MAX_PENDING", 1)
    graphs = make([], when="idle")
    batch = mixed_batch()
    graphs.run(batch, {"full": 4, "sliding": 2})
    graphs.run(batch, {"full": 8, "sliding": 2})  # due too, but the pending list is full
    assert graphs.num_pending == 1
    assert graphs.capture_pending() is True and graphs.capture_pending() is False
    assert graphs.num_graphs == 1
    graphs.run(batch, {"full": 8, "sliding": 2})  # counted again: due, pending now
    assert graphs.num_pending == 1


def test_past_the_limit_the_least_recently_replayed_graph_makes_room():
    """when="idle" with MAX_GRAPHS held: a due key still waits for a quiet moment, whose
    capture drops the graph replayed longest ago; the others stay and replay."""
    graphs = make([], when="idle", max_graphs=2)
    batch = mixed_batch()
    a, b, c = ({"full": n, "sliding": 2} for n in (4, 8, 16))
    for splits in (a, b):
        graphs.run(batch, splits)
        assert graphs.capture_pending() is True
    assert graphs.run(batch, a) is not None  # a replayed last: b is the older
    assert graphs.run(batch, c) is None and graphs.num_pending == 1  # due past the limit
    assert graphs.capture_pending() is True
    assert graphs.num_graphs == 2 and graphs.num_dropped == 1
    replays = graphs.num_replays
    assert graphs.run(batch, a) is not None and graphs.run(batch, c) is not None
    assert graphs.num_replays == replays + 2
    assert graphs.run(batch, b) is None  # dropped: eager, and due again at once
    assert graphs.num_pending == 1
    step = make([], when="step", max_graphs=1)
    step.run(batch, a)
    assert step.run(batch, b) is None and step.num_graphs == 1  # in the step: no room, eager


def test_when_must_be_known(monkeypatch):
    from engine.mixed_graphs import capture_when_setting

    with pytest.raises(ValueError, match="when"):
        make([], when="later")
    monkeypatch.setenv("MBUFO_MIXED_CAPTURE_WHEN", "step")
    assert capture_when_setting() == "step"
    monkeypatch.setenv("MBUFO_MIXED_CAPTURE_WHEN", "")
    assert capture_when_setting() == "idle"
    monkeypatch.setenv("MBUFO_MIXED_CAPTURE_WHEN", "soon")
    with pytest.raises(ValueError, match="MBUFO_MIXED_CAPTURE_WHEN"):
        capture_when_setting()


def test_busy_captures_in_the_step_a_key_that_keeps_coming_without_a_quiet_moment():
    """when="busy": a due key waits for a quiet moment like "idle", but once it has been
    seen BUSY_AFTER more times meanwhile, its step captures it (and it leaves the pending
    list); at the graph limit it waits for a quiet moment instead."""
    from engine.mixed_graphs import BUSY_AFTER

    graphs = make([], capture_at=2, when="busy")
    batch, splits = mixed_batch(), {"full": 4, "sliding": 2}
    for _ in range(1 + BUSY_AFTER):  # the first sighting, then due and waiting
        assert graphs.run(batch, splits) is None
    assert graphs.num_pending == 1 and graphs._capture.captures == 0
    assert graphs.run(batch, splits) is not None  # seen capture_at + BUSY_AFTER times
    assert graphs._capture.captures == 1 and graphs.num_pending == 0
    assert graphs.run(batch, splits) is not None and graphs._capture.captures == 1
    full = make([], capture_at=1, when="busy", max_graphs=1)
    full.run(batch, splits)
    assert full.capture_pending() is True
    other = {"full": 8, "sliding": 2}
    for _ in range(2 + BUSY_AFTER):
        assert full.run(batch, other) is None  # at the limit: never in the step
    assert full.num_pending == 1 and full.capture_pending() is True
    assert full.num_graphs == 1 and full.num_dropped == 1
