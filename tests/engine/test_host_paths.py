"""The host side of a step: batch building (the decode-only shortcut against the general
builder, padding against a plain-list reference), the Engine's hand-off of chunks to
asyncio streams (one loop wake-up per step) and its EngineStats refresh."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

_HELPERS = str(Path(__file__).with_name("scheduler"))  # sched_fakes.py, in any import mode
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
from sched_fakes import greedy, make_core, prompt_of, reference_tokens, req  # noqa: E402

from engine.batch import ForwardBatch, pad_tables  # noqa: E402
from engine.core import build_batch  # noqa: E402
from engine.engine import STATS_INTERVAL_S, Engine  # noqa: E402
from engine.scheduler.plan import Row, RowKind, StepPlan  # noqa: E402


def _fields(batch: ForwardBatch) -> dict:
    return {"input_ids": batch.input_ids.tolist(), "positions": batch.positions.tolist(),
            "query_start": batch.query_start.tolist(), "seq_lens": batch.seq_lens.tolist(),
            "logits_rows": batch.logits_rows.tolist(),
            "tables": {g: t.tolist() for g, t in batch.page_tables.items()}}


def test_pad_tables_matches_plain_lists():
    rows = [[3, 1, 4], [], [1, 5, 9, 2, 6], [5]]
    assert pad_tables(rows).tolist() == [r + [-1] * (5 - len(r)) for r in rows]
    assert pad_tables([[], []]).tolist() == [[-1], [-1]]
    assert pad_tables([]).shape == (0, 1)


def test_built_batches_match_the_definition():
    """Decode-only plans take a shortcut; mixed plans with verify rows the general path.
    Both must give the fields written out by hand from the sequences."""
    core, _ = make_core(num_pages=64, page_size=4, windows={"sliding": 6}, max_sessions=4,
                        prefill_chunk=64)
    for i, n in enumerate((5, 9, 2, 13)):
        core.add(req(f"r{i}", prompt_of(i, n), greedy(30)))
    for _ in range(4):  # prefill, then a few decode steps (a sliding page released)
        core.step()
    seqs = list(core.scheduler.decode_queue)
    assert len(seqs) == 4
    groups = list(core.pool.groups)
    decode = StepPlan([Row(s, 1, RowKind.DECODE) for s in seqs])
    # seqs[2]: a chunk that does not complete the sequence (no logits), seqs[3]: one that
    # does, as if their last tokens were still to compute
    mixed = StepPlan([Row(seqs[0], 1, RowKind.DECODE), Row(seqs[1], 3, RowKind.VERIFY, (7, 8)),
                      Row(seqs[2], 2, RowKind.PREFILL), Row(seqs[3], 3, RowKind.PREFILL)])
    seqs[2].num_computed -= 3
    seqs[3].num_computed -= 2
    try:
        for plan in (decode, mixed):
            got = _fields(build_batch(plan, groups))
            ids, pos, starts, lens, logits = [], [], [0], [], []
            for row in plan.rows:
                seq = row.seq
                new = (seq.token_ids[seq.num_computed:seq.num_computed + row.num_new_tokens]
                       if row.kind is RowKind.PREFILL else [seq.token_ids[-1], *row.draft_ids])
                ids += new
                pos += list(range(seq.num_computed, seq.num_computed + len(new)))
                logits += list(range(starts[-1] + len(new) - row.num_logits,
                                     starts[-1] + len(new)))
                starts.append(starts[-1] + len(new))
                lens.append(seq.num_computed + len(new))
            tables = {g: pad_tables([r.seq.pages.table(g) for r in plan.rows]).tolist()
                      for g in groups}
            assert any(-1 in row for row in tables["sliding"])  # a released page
            assert got == {"input_ids": ids, "positions": pos, "query_start": starts,
                           "seq_lens": lens, "logits_rows": logits, "tables": tables}
            built = build_batch(plan, groups)
            assert built.is_decode_only() == (plan is decode)
            # every token's logits, in order: the forward skips its gather of the rows
            assert built.every_token() == (logits == list(range(len(ids))))
            assert built.to(torch.device("meta")).every_token() == built.every_token()
    finally:
        seqs[2].num_computed += 3
        seqs[3].num_computed += 2
    assert build_batch(decode, groups).every_token()
    assert not build_batch(mixed, groups).every_token()  # a chunk without logits


def test_every_token_on_batches_made_on_a_device():
    """A batch built on a device cannot tell without reading its rows back: False unless
    its maker says so; a prefill whose every token needs logits says True."""
    rows = torch.arange(3)
    made = ForwardBatch(rows, rows, torch.arange(4), rows + 1, {}, rows.to("meta"))
    assert not made.every_token()
    told = ForwardBatch(rows, rows, torch.arange(4), rows + 1, {}, rows.to("meta"),
                        _every_token=True)
    assert told.every_token()
    spans = ForwardBatch.build([([1, 2, 3], 0)], {"full": [[0]]}, logits_rows=[0, 1, 2])
    assert spans.every_token() and not ForwardBatch.build([([1, 2, 3], 0)],
                                                          {"full": [[0]]}).every_token()


def test_async_streams_get_a_step_in_one_wakeup():
    core, _ = make_core(max_sessions=8, prefill_chunk=64)
    engine = Engine(core, "fake").start()
    prompts = {f"a{i}": prompt_of(40 + i, 3 + i) for i in range(8)}
    wakeups = []

    async def main() -> dict[str, list[int]]:
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakeups.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

        async def one(rid: str) -> list[int]:
            return [t async for c in engine.submit(req(rid, prompts[rid], greedy(12)))
                    for t in c.token_ids]

        got = await asyncio.gather(*(one(rid) for rid in prompts))
        return dict(zip(prompts, got, strict=True))

    try:
        got = asyncio.run(main())
        for rid, prompt in prompts.items():
            assert got[rid] == reference_tokens(prompt, greedy(12), 12)
        # 8 streams x 12 tokens: a wake-up per step, not per chunk
        assert 12 <= len(wakeups) < 8 * 12 / 2
        stats = engine.stats()  # refreshed when the engine went idle
        assert stats.sessions == () and stats.num_steps == core.num_steps
    finally:
        engine.stop()


def test_stats_refresh_when_sequences_come_and_go():
    core, _ = make_core(max_sessions=2, prefill_chunk=64)
    engine = Engine(core, "fake")  # driven by hand, no thread
    calls = []
    stats = core.stats
    core.stats = lambda: calls.append(core.num_steps) or stats()  # type: ignore[method-assign]
    core.add(req("x", prompt_of(1, 4), greedy(40)))
    for _ in range(30):
        engine._deliver(core.step())
        engine._refresh_stats()
    # the first step (a new sequence), then at most one per STATS_INTERVAL_S
    assert calls[0] == 1 and len(calls) < 30
    assert engine.stats().sessions[0].request_id == "x"
    engine._stats_due = 0.0
    engine._refresh_stats()
    assert engine.stats().num_steps == 30 and STATS_INTERVAL_S > 0
    core.abort("x")
    engine._deliver(core.step())
    engine._refresh_stats()  # the sequence left: refreshed at once
    assert engine.stats().sessions == ()
