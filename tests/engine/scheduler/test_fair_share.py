"""Fair share: a client holding every slot gives one up to a client with none."""

from __future__ import annotations

from sched_fakes import greedy, make_core, prompt_of, reference_tokens, req, run_all, tokens_of


def test_starved_client_gets_a_slot_at_once_and_outputs_stay_exact() -> None:
    core, _ = make_core(num_pages=1024, max_sessions=4)
    for i in range(6):
        core.add(req(f"h{i}", prompt_of(i, 8), greedy(40), client="heavy"))
    early = []
    for _ in range(10):  # the heavy client holds all four slots and streams
        early.extend(core.step())
    assert {s.request.client_id for s in core.scheduler.running} == {"heavy"}
    core.add(req("light", prompt_of(99, 8), greedy(4), client="light"))
    early.extend(core.step())
    plan = core.stats().last_plan
    assert "light" in plan.admitted and len(plan.preempted) == 1
    assert any(d.policy == "fair_share" for d in plan.decisions)
    out: dict = {}
    for chunk in early:
        out.setdefault(chunk.request_id, []).append(chunk)
    for rid, chunks in run_all(core).items():
        out.setdefault(rid, []).extend(chunks)
    assert len(out) == 7
    # every request, preempted or not, gives exactly what it gives alone
    for rid, chunks in out.items():
        seed = 99 if rid == "light" else int(rid[1:])
        n = 4 if rid == "light" else 40
        assert tokens_of(chunks) == reference_tokens(prompt_of(seed, 8), greedy(n), n), rid


def test_no_preemption_when_shares_are_fair() -> None:
    core, _ = make_core(num_pages=1024, max_sessions=4)
    for c in ("a", "b"):
        for i in range(2):
            core.add(req(f"{c}{i}", prompt_of(i, 8), greedy(20), client=c))
    core.add(req("a9", prompt_of(9, 8), greedy(4), client="a"))  # waits: a holds its share
    for _ in range(5):
        core.step()
    assert core.scheduler.num_preemptions == 0
    core.add(req("c0", prompt_of(5, 8), greedy(4), client="c"))
    core.step()  # c is starved; a and b hold 2 each > share 4 // 3 = 1: one yields
    assert core.scheduler.num_preemptions == 1
    run_all(core)
