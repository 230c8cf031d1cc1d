"""Prefill packing on the real default model: short prompts of four clients are prefilled
in one forward, and each streams exactly the tokens it streams alone."""

from __future__ import annotations

import pytest

from engine.build import EngineOptions, build_core
from engine.loader import load
from engine.sampler import SamplingParams
from engine.scheduler.request import Request

PROMPTS = ["The lighthouse keeper climbed", "Water boils at", "def fibonacci(n):",
           "The three primary colors are"]


@pytest.fixture(scope="module")
def loaded():
    return load("default")


def _core(loaded):
    return build_core(loaded, EngineOptions(sessions=4, context=256, prefill_chunk=64,
                                            itl_target_ms=None))


def _request(loaded, i: int, rid: str) -> Request:
    ids = tuple(loaded.tokenizer.encode(PROMPTS[i]))
    return Request(rid, ids, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                   client_id=f"client{i}")


def _drain(core, out: dict[str, list[int]]) -> None:
    for _ in range(100):
        if not core.has_work():
            return
        for chunk in core.step():
            out.setdefault(chunk.request_id, []).extend(chunk.token_ids)
    raise AssertionError("the core did not finish")


def test_four_clients_prompts_share_one_forward_and_match_solo(loaded):
    solo: dict[str, list[int]] = {}
    core = _core(loaded)
    for i in range(len(PROMPTS)):
        core.add(_request(loaded, i, f"r{i}"))
        _drain(core, solo)
    packed: dict[str, list[int]] = {}
    core = _core(loaded)  # a fresh prefix cache: the prompts are computed again
    for i in range(len(PROMPTS)):
        core.add(_request(loaded, i, f"r{i}"))
    for chunk in core.step():
        packed.setdefault(chunk.request_id, []).extend(chunk.token_ids)
    rows = core.stats().last_plan.rows
    lengths = {f"r{i}": len(loaded.tokenizer.encode(p)) for i, p in enumerate(PROMPTS)}
    assert sorted((r.request_id, r.kind, r.num_new_tokens) for r in rows) == \
        sorted((rid, "prefill", n) for rid, n in lengths.items())
    assert sorted(packed) == sorted(lengths)  # every prompt's first token from that forward
    _drain(core, packed)
    assert packed == solo and all(len(t) == 2 for t in solo.values())
