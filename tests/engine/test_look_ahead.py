"""Look-ahead decode steps (EngineCore launches the next decode step from the sampled ids
still on the device, before the host reads them): on the CPU with a fake graph capture,
the tokens, finishes and pages are those of the same engine without look-ahead, through
rows that stop (length and abort), a request that arrives mid-decode, requests queued
behind a full box, sampled and penalised rows, a sliding window, logprobs, and a pool too
small for the next page."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from graph_fakes import FakeCapture

from engine.batch import ForwardBatch
from engine.core import EngineCore
from engine.loader import load
from engine.runner import ModelRunner
from engine.sampler import SamplingParams
from engine.scheduler.request import Request
from engine.scheduler.scheduler import SchedulerConfig
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

CONTEXT = 96


def tiny(tmp_path_factory, vocab_dir, family: str, window: int | None = None):
    spec = SyntheticSpec(family, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                         head_dim=16, ffn_size=128, sliding_window=window, default_type=T.F32)
    path = tmp_path_factory.mktemp("ahead") / f"{family}.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
    return load(path, torch.float32, "cpu")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, vocab_dir):
    return tiny(tmp_path_factory, vocab_dir, "llama")


@pytest.fixture(scope="module")
def sliding(tmp_path_factory, vocab_dir):
    """gemma3 with a 24-token window: a full and a sliding group, whose pages out of the
    window are released while a step looks ahead."""
    return tiny(tmp_path_factory, vocab_dir, "gemma3", window=24)


def make_core(loaded, look_ahead: bool, pages: int = 40, graphs: bool = True,
              sessions: int = 4) -> EngineCore:
    runner = ModelRunner(loaded.model, pages, 16, "f16", cuda_graphs=graphs,
                         max_context=CONTEXT, capture=FakeCapture() if graphs else None)
    config = SchedulerConfig(max_sessions=sessions, context=CONTEXT, prefill_chunk=32,
                             itl_target_ms=None, max_pending_per_client=None)
    return EngineCore(runner, loaded.tokenizer, config, vocab_size=loaded.config.vocab_size,
                      look_ahead=look_ahead)


def prompt(i: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(100 + i)
    return torch.randint(3, 1000, (n,), generator=gen).tolist()


def request(rid: str, ids: list[int], **sampling) -> Request:
    sampling.setdefault("ignore_eos", True)
    return Request(rid, tuple(ids), SamplingParams(**sampling))


@pytest.fixture
def request_fixture(request):
    return request.getfixturevalue


def drive(core: EngineCore, script: dict[int, list], aborts: dict[int, str]) -> dict:
    """Step until idle; `script` adds requests before step n, `aborts` aborts one.
    -> request id -> (token ids, finish reason, logprobs)."""
    out: dict[str, tuple] = {}
    n = 0
    while n <= max(script) or core.has_work():
        for r in script.get(n, []):
            core.add(r)
        if n in aborts:
            core.abort(aborts[n])
        for chunk in core.step():
            ids, _, lps = out.get(chunk.request_id, ([], None, []))
            out[chunk.request_id] = (ids + list(chunk.token_ids), chunk.finish_reason,
                                     lps + list(chunk.logprobs or ()))
        n += 1
    return out


def free_pages(core: EngineCore) -> dict[str, int]:
    if core.radix is not None:
        core.radix.evict(10**9)
    return {g: p.num_free for g, p in core.pool.groups.items()}


@pytest.mark.parametrize("model", ["loaded", "sliding"])
def test_same_tokens_as_without_look_ahead(model, request_fixture):
    """Also with logprobs (read back with the tokens) and, for gemma3, pages that leave
    the window under a launched step."""
    loaded = request_fixture(model)
    script = {0: [request("long", prompt(0, 9), temperature=0.0, max_tokens=30, logprobs=2),
                  request("short", prompt(1, 20), temperature=0.0, max_tokens=5),
                  request("drawn", prompt(2, 14), temperature=0.9, top_p=0.9, seed=7,
                          max_tokens=24)],
              12: [request("late", prompt(3, 40), temperature=0.0, max_tokens=10)],
              30: [request("penalised", prompt(4, 6), temperature=0.0, max_tokens=8,
                           repetition_penalty=1.3)]}
    aborts = {18: "drawn"}
    cores = [make_core(loaded, look_ahead) for look_ahead in (True, False)]
    before = [free_pages(c) for c in cores]
    ahead, plain = (drive(c, script, aborts) for c in cores)
    assert {r: v[:2] for r, v in ahead.items()} == {r: v[:2] for r, v in plain.items()}
    assert [len(ahead[r][0]) for r in ("long", "short", "late", "penalised")] == [30, 5, 10, 8]
    # logprobs where asked, for the same ids (CPU matmuls round a row a little differently
    # beside another number of rows)
    assert len(ahead["long"][2]) == 30 and not ahead["short"][2]
    for a, b in zip(ahead["long"][2], plain["long"][2], strict=True):
        assert (a.token_id, [i for i, _ in a.top]) == (b.token_id, [i for i, _ in b.top])
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert ahead["drawn"][1] == "abort" and 0 < len(ahead["drawn"][0]) < 24
    # most decode steps came from a launch ahead; none without look-ahead
    assert cores[0].num_ahead_steps > 20 and cores[1].num_ahead_steps == 0
    assert cores[0].num_ahead_steps < cores[0].num_steps
    assert cores[0].stats().num_ahead_steps == cores[0].num_ahead_steps  # the dashboard's
    assert cores[0].stats().graphs == cores[0].runner.num_graphs > 0  # decode and mixed
    assert [free_pages(c) for c in cores] == before  # the pages ahead-steps took came back


def test_a_queue_behind_a_full_box_does_not_stop_it(loaded):
    """Two sessions, five requests: while requests wait for a slot the decoders still
    look ahead; each finish admits the next (the launched step is then discarded), and
    the tokens are those without look-ahead."""
    script = {0: [request(f"r{i}", prompt(i, 6 + 3 * i), temperature=0.0, max_tokens=8 + 2 * i)
                  for i in range(5)]}
    cores = [make_core(loaded, look_ahead, sessions=2) for look_ahead in (True, False)]
    ahead, plain = (drive(c, script, {}) for c in cores)
    assert {r: v[:2] for r, v in ahead.items()} == {r: v[:2] for r, v in plain.items()}
    assert [len(ahead[f"r{i}"][0]) for i in range(5)] == [8, 10, 12, 14, 16]
    waiting_steps = []
    core = make_core(loaded, True, sessions=2)
    for r in script[0]:
        core.add(r)
    while core.has_work():
        before = core.num_ahead_steps
        core.step()
        if core.scheduler.num_waiting:
            waiting_steps.append(core.num_ahead_steps - before)
    assert sum(waiting_steps) > 10  # looked ahead while requests queued


def test_no_look_ahead_without_graphs_or_with_penalties(loaded):
    core = make_core(loaded, True, graphs=False)
    out = drive(core, {0: [request("a", prompt(0, 9), temperature=0.0, max_tokens=12)]}, {})
    assert len(out["a"][0]) == 12 and core.num_ahead_steps == 0
    core = make_core(loaded, True)
    out = drive(core, {0: [request("p", prompt(0, 9), temperature=0.0, max_tokens=12,
                                   frequency_penalty=0.5)]}, {})
    assert len(out["p"][0]) == 12 and core.num_ahead_steps == 0


def test_a_full_pool_runs_the_step_in_turn(loaded):
    """Three pages for two sequences of two pages each: the step that would need the
    last page for one of them is not launched ahead, the scheduler preempts the other in
    turn, and the tokens stay those of a roomy pool without look-ahead."""
    script = {0: [request(r, prompt(i, 12), temperature=0.0, max_tokens=20)
                  for i, r in enumerate("ab")]}
    small, roomy = make_core(loaded, True, pages=3), make_core(loaded, False)
    assert drive(small, script, {}) == drive(roomy, script, {})
    assert small.scheduler.num_preemptions > 0
    assert 0 < small.num_ahead_steps < small.num_steps - 2


def test_forward_ahead_reads_its_ids_from_the_device(loaded):
    runner = ModelRunner(loaded.model, 8, 16, "f16", cuda_graphs=True, max_context=CONTEXT,
                         capture=FakeCapture())
    tables = {g: [[0], [1]] for g in runner.pool.groups}
    spans = [([5], 3), ([6], 0)]
    want = runner.forward_eager(ForwardBatch.build([([7], 3), ([9], 0)], tables))
    got = runner.forward_ahead(ForwardBatch.build(spans, tables), torch.tensor([7, 9]))
    assert got is not None and torch.equal(got, want)
    wide = {g: [[0] * 7, [1]] for g in runner.pool.groups}  # past max_context's tables
    assert runner.forward_ahead(ForwardBatch.build([([5], 100), ([6], 0)], wide),
                                torch.tensor([7, 9])) is None
