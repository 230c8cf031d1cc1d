"""The scheduler's guarantees with the real default model, stepping EngineCore directly:
every step is inspected (its StepPlan snapshot), so each guarantee is checked exactly."""

from __future__ import annotations

import pytest

from engine.build import EngineOptions, build_core
from engine.errors import ClientQuotaExceeded
from engine.loader import load
from engine.sampler import SamplingParams
from engine.scheduler.request import Request

CHUNK = 64


@pytest.fixture(scope="module")
def loaded():
    return load("default")


def _core(loaded, **kw):
    opts = dict(sessions=3, context=1024, prefill_chunk=CHUNK, itl_target_ms=None)
    opts.update(kw)
    return build_core(loaded, EngineOptions(**opts))


def _req(loaded, rid: str, text: str, max_tokens: int, client: str = "local") -> Request:
    ids = tuple(loaded.tokenizer.encode(text))
    return Request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                            ignore_eos=True), client_id=client)


def _run(core, max_steps: int = 400):
    """Step until idle; -> the plans and, per plan, the requests that finished in it."""
    plans, done, finished = [], [], set()
    for _ in range(max_steps):
        if not core.has_work():
            break
        ended = {c.request_id for c in core.step() if c.finish_reason}
        finished |= ended
        plans.append(core.stats().last_plan)
        done.append(ended)
    return plans, done, finished


def test_decoders_run_every_step_while_a_long_prompt_prefills(loaded):
    """Guarantees 1-3: a due decoder never waits behind a prefill (prefill merges into the
    decode steps), every resident decoder is in every step, and each chunk is bounded."""
    core = _core(loaded)
    core.add(_req(loaded, "d1", "The lighthouse keeper", 30))
    core.add(_req(loaded, "d2", "Water boils at", 30))
    for _ in range(4):  # both are decoding now
        core.step()
    core.add(_req(loaded, "long", "the history of coastal trade " * 60, 1))
    plans, done, finished = _run(core)
    assert {"d1", "d2", "long"} <= finished
    prefill_steps = [p for p in plans if any(r.kind == "prefill" for r in p.rows)]
    assert len(prefill_steps) >= 4  # the long prompt really was chunked
    resident = {"d1", "d2"}
    for plan, ended in zip(plans, done, strict=True):
        ids = {r.request_id for r in plan.rows}
        assert resident <= ids, f"a decoder skipped a step: {plan.rows}"
        assert all(r.num_new_tokens <= CHUNK for r in plan.rows if r.kind == "prefill")
        resident -= ended


def test_mixed_batch_off_alternates(loaded):
    core = _core(loaded, mixed_batch=False)
    core.add(_req(loaded, "d1", "Once upon a time", 12))
    for _ in range(3):
        core.step()
    core.add(_req(loaded, "long", "a fox runs through the forest " * 30, 1))
    plans, _, _ = _run(core)
    for plan in plans:
        kinds = {r.kind for r in plan.rows}
        assert not ({"prefill"} < kinds), "mixed step while mixed batching is off"


def test_client_quota_and_round_robin_admission(loaded):
    core = _core(loaded, sessions=1, max_pending_per_client=3)
    for i in range(3):
        core.add(_req(loaded, f"heavy{i}", f"Heavy request {i}", 2, client="heavy"))
    with pytest.raises(ClientQuotaExceeded) as err:
        core.add(_req(loaded, "heavy3", "one too many", 2, client="heavy"))
    assert err.value.code == "client_quota"
    core.add(_req(loaded, "light0", "Light request", 2, client="light"))
    order = []
    for _ in range(200):
        if not core.has_work():
            break
        core.step()
        order.extend(a for a in core.stats().last_plan.admitted if a not in order)
    # the light client's single request is admitted before the heavy client's backlog ends
    assert order.index("light0") < order.index("heavy2"), order
