"""Client round robin: per-client FIFOs, admission rotating over clients, pending limits."""

from __future__ import annotations

import pytest
from sched_fakes import make_core, prompt_of, req

from engine.errors import ClientQuotaExceeded, EngineError
from engine.scheduler.policies.client_rr import ClientRoundRobin


def _seqs(core, spec: list[tuple[str, str]]):
    for rid, client in spec:
        core.add(req(rid, prompt_of(len(rid), 4), client=client))
    return [core.scheduler.seqs[rid] for rid, _ in spec]


def test_pop_rotates_over_clients_fifo_within_each() -> None:
    core, _ = make_core()
    seqs = _seqs(core, [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B"), ("c1", "C"),
                        ("b2", "B")])
    rr = ClientRoundRobin()
    for s in seqs:
        rr.push(s)
    order = []
    while (s := rr.pop()) is not None:
        order.append(s.request_id)
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3"]
    assert len(rr) == 0


def test_new_client_joins_at_the_back_of_the_turn() -> None:
    core, _ = make_core()
    a1, a2, b1, c1 = _seqs(core, [("a1", "A"), ("a2", "A"), ("b1", "B"), ("c1", "C")])
    rr = ClientRoundRobin()
    for s in (a1, a2, b1):
        rr.push(s)
    assert rr.pop() is a1
    rr.push(c1)  # A (a2) goes after B, C after A
    assert [rr.pop(), rr.pop(), rr.pop()] == [b1, a2, c1]


def test_limits_and_remove() -> None:
    core, _ = make_core()
    a1, a2, a3, b1 = _seqs(core, [("a1", "A"), ("a2", "A"), ("a3", "A"), ("b1", "B")])
    rr = ClientRoundRobin(max_pending=2)
    rr.push(a1)
    rr.push(a2)
    with pytest.raises(ClientQuotaExceeded) as err:
        rr.push(a3)
    assert isinstance(err.value, EngineError) and err.value.code == "client_quota"
    rr.set_limit("B", 0)  # per-client override (an API key's quota)
    with pytest.raises(ClientQuotaExceeded):
        rr.push(b1)
    assert rr.remove(a1) and not rr.remove(a1)
    rr.push(a3)  # room again
    assert rr.num_pending("A") == 2 and [s for s in rr.waiting()[0][1]] == [a2, a3]
