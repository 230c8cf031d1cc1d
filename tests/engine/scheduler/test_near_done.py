"""Near-done gate: long chunks step aside while a full house waits on a finishing decoder."""

from __future__ import annotations

from sched_fakes import greedy, make_core, plan_rows, prompt_of, req, run_all

from engine.scheduler.policies.near_done import NearDoneGate


def _decoders(core, remaining: list[int]):
    seqs = []
    for i, left in enumerate(remaining):
        core.add(req(f"d{i}", prompt_of(i, 4), greedy(left)))
        seqs.append(core.scheduler.seqs[f"d{i}"])
    return seqs


def test_gate_conditions() -> None:
    core, _ = make_core()
    far, near = _decoders(core, [500, 64])
    gate = NearDoneGate(window=64, short_chunk=64, max_consecutive=3)
    assert gate.should_yield(512, [far, near], num_waiting=1) is not None
    assert gate.should_yield(512, [far, near], num_waiting=0) is None  # nobody waits
    assert gate.should_yield(64, [far, near], num_waiting=1) is None  # a short chunk runs
    assert gate.should_yield(512, [far], num_waiting=1) is None  # nobody near done
    for _ in range(3):
        gate.record(yielded=True, ran_prefill=False)
    assert gate.should_yield(512, [near], num_waiting=1) is None  # the safety valve
    gate.record(yielded=False, ran_prefill=True)
    assert gate.should_yield(512, [near], num_waiting=1) is not None


def _scenario(waiting: bool) -> list[list[tuple[str, str, int]]]:
    core, _ = make_core(num_pages=1024, max_sessions=2, prefill_chunk=128)
    core.add(req("d", prompt_of(1, 4), greedy(70)))
    core.step()
    core.add(req("long", prompt_of(2, 3000), greedy(1)))
    if waiting:
        core.add(req("w", prompt_of(3, 4), greedy(1)))
    steps = []
    while "d" in core.scheduler.seqs:
        core.step()
        steps.append(plan_rows(core))
    run_all(core)
    return steps


def test_long_chunks_yield_while_a_request_waits_for_the_slot() -> None:
    steps = _scenario(waiting=True)
    # d has 69 tokens left after its first: within the window from its 6th decode step.
    assert len(steps) == 69
    assert all(("long", "prefill", 128) in rows for rows in steps[:5])
    assert all(rows == [("d", "decode", 1)] for rows in steps[5:])  # decode-only


def test_no_yield_without_waiting_requests() -> None:
    steps = _scenario(waiting=False)
    assert all(("long", "prefill", 128) in rows for rows in steps[:23])
