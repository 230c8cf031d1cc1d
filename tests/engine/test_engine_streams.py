"""Engine.stream's hand-off to consuming threads: every chunk in order with its finish
reason, one wake-up per burst, disconnects and slow readers (a reader that does not come
back in time must not stall the loop thread, and still gets every chunk)."""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

import pytest

_HELPERS = str(Path(__file__).with_name("scheduler"))  # sched_fakes.py, in any import mode
if _HELPERS not in sys.path:
    sys.path.insert(0, _HELPERS)
from sched_fakes import EOS, greedy, make_core, prompt_of, reference_tokens, req  # noqa: E402

import engine.engine as engine_module  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.errors import EngineError  # noqa: E402


def _consume(engine: Engine, out: dict, rid: str, prompt: list[int], params,
             delay: float = 0.0) -> None:
    chunks = []
    try:
        for chunk in engine.stream(req(rid, prompt, params), timeout=30):
            chunks.append(chunk)
            if delay:
                time.sleep(delay)
    except EngineError as exc:
        chunks.append(exc)
    out[rid] = chunks


def _run_threads(engine: Engine, jobs: dict[str, tuple]) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=_consume, args=(engine, out, rid, *job))
               for rid, job in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_threads_get_every_chunk_in_order_with_finish_reasons():
    core, _ = make_core(max_sessions=8, prefill_chunk=64)
    engine = Engine(core, "fake").start()
    prompts = {f"s{i}": prompt_of(70 + i, 3 + i) for i in range(6)}
    params = {rid: greedy(5 + 3 * i) for i, rid in enumerate(prompts)}
    params["s5"] = greedy(40, ignore_eos=False, stop_token_ids=(7, 9, 11))  # may stop early
    try:
        out = _run_threads(engine, {rid: (prompts[rid], params[rid]) for rid in prompts})
    finally:
        engine.stop()
    for rid, prompt in prompts.items():
        chunks = out[rid]
        want = reference_tokens(prompt, params[rid], params[rid].max_tokens)
        assert [t for c in chunks for t in c.token_ids] == want
        assert [c.completion_tokens for c in chunks] == \
            [sum(len(c.token_ids) for c in chunks[: i + 1]) for i in range(len(chunks))]
        assert all(c.finish_reason is None for c in chunks[:-1])
        stopped = want[-1] in params[rid].stop_token_ids or \
            (want[-1] == EOS and not params[rid].ignore_eos)
        assert chunks[-1].finish_reason == ("stop" if stopped else "length")
        assert "".join(c.text for c in chunks) == "".join(
            f"<{t}>" for t in (want[:-1] if stopped else want))


def test_a_reader_that_leaves_aborts_and_the_others_go_on():
    core, _ = make_core(max_sessions=4, prefill_chunk=64)
    engine = Engine(core, "fake").start()
    try:
        got = []
        for chunk in engine.stream(req("gone", prompt_of(1, 4), greedy(500)), timeout=30):
            got.append(chunk)
            if len(got) == 3:
                break  # closes the generator: the request is aborted
        deadline = time.monotonic() + 10
        while "gone" in core.scheduler.seqs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "gone" not in core.scheduler.seqs and len(got) == 3
        out = _run_threads(engine, {"next": (prompt_of(2, 4), greedy(6))})
        assert [t for c in out["next"] for t in c.token_ids] == \
            reference_tokens(prompt_of(2, 4), greedy(6), 6)
    finally:
        engine.stop()


def test_a_slow_reader_does_not_hold_the_loop(monkeypatch):
    monkeypatch.setattr(engine_module, "HANDBACK_BASE_S", 0.001)
    monkeypatch.setattr(engine_module, "HANDBACK_PER_READER_S", 0.0)
    core, _ = make_core(max_sessions=4, prefill_chunk=64)
    engine = Engine(core, "fake").start()
    fast, slow = prompt_of(3, 5), prompt_of(4, 5)
    try:
        start = time.monotonic()
        out = _run_threads(engine, {"fast": (fast, greedy(30)),
                                    "slow": (slow, greedy(30), 0.05)})
        elapsed = time.monotonic() - start
    finally:
        engine.stop()
    assert [t for c in out["fast"] for t in c.token_ids] == reference_tokens(fast, greedy(30), 30)
    assert [t for c in out["slow"] for t in c.token_ids] == reference_tokens(slow, greedy(30), 30)
    assert out["slow"][-1].finish_reason == "length"
    # the slow reader took a burst of chunks at a time, not one wake-up per step
    assert len(out["slow"]) == 30 and elapsed < 30 * 0.05 * 1.5 + 5


def test_each_burst_wakes_a_reader_once():
    core, _ = make_core(max_sessions=4, prefill_chunk=64)
    engine = Engine(core, "fake")  # driven by hand: several steps before the reader runs
    rings = []
    original = engine_module._Mailbox.ring

    def counted(self, handback):
        rings.append(self)
        original(self, handback)

    engine_module._Mailbox.ring = counted  # type: ignore[method-assign]
    try:
        engine._running = True
        box = engine_module._Mailbox()  # what stream() reads from
        engine.add(req("b", prompt_of(5, 4), greedy(8)), box)
        engine._drain_inbox()
        for _ in range(4):  # nobody reads yet: no wake-up
            engine._deliver(core.step())
        assert rings == []
        got = [box.get(5) for _ in range(4)]  # four chunks waiting: the reader never sleeps
        assert rings == []

        def read() -> None:
            while not got or got[-1].finish_reason is None:
                got.append(box.get(5))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 5
        while core.has_work() and time.monotonic() < deadline:
            engine._deliver(core.step())
        reader.join(10)
        assert [t for c in got for t in c.token_ids] == \
            reference_tokens(prompt_of(5, 4), greedy(8), 8)
        assert len(rings) <= 4 and got[-1].finish_reason == "length"
    finally:
        engine_module._Mailbox.ring = original  # type: ignore[method-assign]


def test_stream_timeout_and_stop_errors():
    core, _ = make_core(max_sessions=2, prefill_chunk=64)
    engine = Engine(core, "fake")  # not started: nothing is ever delivered
    engine._running = True
    stream = engine.stream(req("t", prompt_of(6, 4), greedy(4)), timeout=0.05)
    with pytest.raises(queue.Empty):
        next(stream)
    engine._running = False
    engine = Engine(core, "fake2").start()
    engine.stop()
    with pytest.raises(EngineError):
        next(engine.stream(req("u", prompt_of(7, 4), greedy(4))))


def test_stats_drop_a_request_before_its_last_chunk_goes_out(monkeypatch):
    """A caller that has read its request's last chunk reads stats without the request:
    the loop refreshes them before it delivers a step that finishes one (here the refresh
    is slowed down, so reading stats between delivery and refresh would see the request)."""
    core, _ = make_core(max_sessions=4, prefill_chunk=64)
    engine = Engine(core, "fake").start()
    refresh = Engine._refresh_stats

    def slow_refresh(self) -> None:
        time.sleep(0.05)
        refresh(self)

    monkeypatch.setattr(Engine, "_refresh_stats", slow_refresh)
    try:
        for i in range(3):
            chunks = list(engine.stream(req(f"r{i}", prompt_of(40 + i, 5), greedy(3)),
                                        timeout=30))
            assert chunks[-1].finish_reason == "length"
            stats = engine.stats()
            assert not stats.sessions and stats.num_waiting == 0, stats
    finally:
        engine.stop()


def test_quiet_moments_go_to_the_core_idle_work(monkeypatch):
    """After IDLE_GRACE_S with no request posted or in the core, the loop thread hands the
    runner's idle work (a deferred graph capture) one piece at a time until there is none,
    never while a request is in the core; a request then is served as usual."""
    monkeypatch.setattr(engine_module, "IDLE_GRACE_S", 0.05)
    core, runner = make_core(max_sessions=4, prefill_chunk=64)
    calls: list[bool] = []
    pieces = [True, True, True]

    def idle() -> bool:
        calls.append(core.has_work())
        if not pieces:
            return False
        runner.num_graphs += 1  # a capture
        return pieces.pop()

    runner.idle, runner.num_graphs = idle, 0
    engine = Engine(core, "fake").start()
    try:
        deadline = time.monotonic() + 10
        while len(calls) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 4  # three pieces, then none: the loop sleeps
        assert engine.stats().graphs == 3  # the stats show what the idle work did
        out = _run_threads(engine, {"a": (prompt_of(5, 6), greedy(4))})
        while len(calls) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        engine.stop()
    assert [c.finish_reason for c in out["a"]][-1] == "length"
    assert len(calls) >= 5 and not any(calls)  # asked again once quiet, never while busy


def test_requests_close_together_do_not_wait_for_idle_work(monkeypatch):
    """Within the grace a posted request is served before any idle work starts."""
    monkeypatch.setattr(engine_module, "IDLE_GRACE_S", 30.0)
    core, runner = make_core(max_sessions=4, prefill_chunk=64)
    calls: list[bool] = []
    runner.idle = lambda: calls.append(True) or False
    engine = Engine(core, "fake").start()
    try:
        for i in range(3):
            out = _run_threads(engine, {f"r{i}": (prompt_of(i, 6), greedy(3))})
            assert out[f"r{i}"][-1].finish_reason == "length"
    finally:
        engine.stop()
    assert calls == []
