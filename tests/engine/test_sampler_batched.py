"""The batched Sampler against a per-row reference written from the definitions.

Every row of a mixed batch (plain greedy rows take the raw logits' argmax, the others the
float64 path) must give the token that one row alone gives under the documented chain:
numpy penalties and filters in float64, then the inverse CDF at the row's own uniform
draw (its seed's stream, blocks of 32 float64 from a CPU torch.Generator). Greedy rows:
the first maximum of the (penalized) logits, also for bf16 logits full of ties. Logprobs:
float64 log_softmax of the raw logits. And one step makes one device->host copy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sampler_ref import one_thread, penalized  # noqa: F401 (one_thread: autouse fixture)

from engine.sampler import Sampler, SamplerState, SamplingParams

VOCAB = 96


def reference_probs(logits, params, prompt_ids, output_ids):
    """Temperature, then top-k, top-p (the token crossing top_p kept) and min-p."""
    x = penalized(logits, params, prompt_ids if params.repetition_penalty != 1 else (),
                  output_ids) / params.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep = order[:params.top_k] if params.top_k > 0 else order
    mass, cum, chosen = sum(p[i] for i in keep), 0.0, []
    for i in keep:
        chosen.append(i)
        cum += p[i] / mass
        if cum >= params.top_p:
            break
    q = np.array([p[i] if i in chosen and p[i] >= params.min_p * p.max() else 0.0
                  for i in range(len(p))])
    return q / q.sum()


class UniformStream:
    """The k-th U[0, 1) of a seed: blocks of 32 float64 from a seeded CPU generator."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.values: list[float] = []

    def next(self) -> float:
        if not self.values:
            self.values = torch.rand(32, generator=self.gen, dtype=torch.float64).tolist()
        return self.values.pop(0)


def reference_token(logits, params, prompt, outputs, stream: UniformStream | None) -> int:
    if params.temperature == 0 or params.top_k == 1:
        x = penalized(logits, params, prompt if params.repetition_penalty != 1 else (),
                      outputs)
        return int(np.flatnonzero(x == x.max())[0])
    probs = reference_probs(logits, params, prompt, outputs)
    assert stream is not None
    return int(np.searchsorted(np.cumsum(probs), stream.next(), side="right"))


PARAMS = [
    SamplingParams(temperature=0.0),  # plain greedy
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=0.8, top_p=0.9, seed=11),
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
    SamplingParams(top_k=7, seed=12, logprobs=2),
    SamplingParams(temperature=1.3, min_p=0.05, presence_penalty=0.5, seed=13),
    SamplingParams(top_k=1, temperature=0.7),  # greedy through top_k
    SamplingParams(temperature=0.6, top_p=0.5, top_k=20, repetition_penalty=1.2, seed=14),
]


@pytest.mark.parametrize("order", ["as_listed", "reversed", "greedy_only"])
def test_batch_matches_per_row_reference(order):
    params = {"as_listed": PARAMS, "reversed": PARAMS[::-1],
              "greedy_only": [PARAMS[0], PARAMS[0], PARAMS[1]]}[order]
    rng = np.random.default_rng(21)
    prompt = [1, 5, 9, 40]
    states = [SamplerState.create(p, prompt, VOCAB) for p in params]
    streams = [None if p.seed is None else UniformStream(p.seed) for p in params]
    outputs: list[list[int]] = [[] for _ in params]
    sampler, random_rows = Sampler(), 0
    for _ in range(40):  # past one block of 32 uniforms
        logits = rng.standard_normal((len(params), VOCAB)).astype(np.float32) * 3
        out = sampler.sample(torch.from_numpy(logits), states)
        for i, p in enumerate(params):
            want = reference_token(logits[i], p, prompt, outputs[i], streams[i])
            assert out.token_ids[i] == want, (i, p)
            outputs[i].append(want)
            if p.logprobs is None:
                assert out.logprobs[i] is None
                continue
            x = logits[i].astype(np.float64)
            ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
            lp = out.logprobs[i]
            assert lp.token_id == want and abs(lp.logprob - ref[want]) < 1e-5
            assert [t for t, _ in lp.top] == list(np.argsort(-ref, kind="stable")[:p.logprobs])
        random_rows += sum(not p.is_greedy for p in params)
    assert order == "greedy_only" or random_rows > 0


def test_plain_greedy_ties_in_bf16_go_to_the_lowest_id():
    """bf16 logits tie often; the raw-logits argmax (a batch of plain greedy rows) and the
    float64 path (the same rows beside a sampled row) both take the first maximum."""
    rng = np.random.default_rng(22)
    logits = torch.from_numpy(rng.integers(-3, 4, size=(16, VOCAB)).astype(np.float32) / 4)
    logits = logits.to(torch.bfloat16)
    want = [int(np.flatnonzero(r == r.max())[0]) for r in logits.float().numpy()]
    greedy = [SamplerState.create(SamplingParams(temperature=0.0), [], VOCAB)
              for _ in range(16)]
    assert all(s.is_plain_greedy for s in greedy)
    assert Sampler().sample(logits, greedy).token_ids == want
    mixed = greedy + [SamplerState.create(SamplingParams(seed=3), [], VOCAB)]
    extra = torch.cat([logits, logits[:1]])
    assert Sampler().sample(extra, mixed).token_ids[:16] == want


def test_one_host_transfer_per_step(monkeypatch):
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=1, logprobs=4),
              SamplingParams(temperature=0.0, logprobs=2), SamplingParams(top_p=0.7, seed=2)]
    states = [SamplerState.create(p, [], VOCAB) for p in params]
    for s in states:
        s.uniforms = [0.25] * 4  # drawn ahead: no generator block in this step
    calls = []
    for name in ("tolist", "item", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, _n=name, **k:
                            calls.append(_n) or _o(self, *a, **k))
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5))
    out = Sampler().sample(logits, states)
    assert calls == ["tolist"]
    assert out.logprobs[0] is None and len(out.logprobs[1].top) == 4
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == out.logprobs[2][0]
    calls.clear()
    Sampler().sample(logits[:2], [SamplerState.create(SamplingParams(temperature=0.0), [],
                                                      VOCAB) for _ in range(2)])
    assert calls == ["tolist"]


def test_cpu_candidate_filter_matches_reference_and_falls_back(monkeypatch):
    """Vocabularies past 4 x 256 ids: top-k/top-p on the CPU look at the 256 largest
    weights first. Rows whose support ends inside them (ties included) must match the
    reference; rows that need more (a flat nucleus, top_k past 256, a tie straddling the
    256th weight) take the full sort, and match it too."""
    import engine.sampler_filters as filters_module

    vocab = 3000
    calls = []
    original = filters_module.top_k_top_p
    monkeypatch.setattr(filters_module, "top_k_top_p", lambda *a, **k: calls.append(
        k.get("full_sort", False)) or original(*a, **k))
    rng = np.random.default_rng(23)
    peaked = rng.standard_normal(vocab) * 4
    flat = rng.standard_normal(vocab) * 0.05
    medium = rng.standard_normal(vocab) * 1.5
    ties = np.floor(rng.standard_normal(vocab) * 2) * 2  # few distinct values: wide ties
    cases = [(peaked, SamplingParams(top_p=0.9, seed=1)),
             (peaked, SamplingParams(top_k=40, temperature=0.7, seed=2)),
             (peaked, SamplingParams(top_k=5, top_p=0.5, min_p=0.1, seed=3)),
             (flat, SamplingParams(top_p=0.95, seed=4)),  # nucleus of ~2800 ids: full sort
             (peaked, SamplingParams(top_k=700, seed=5)),  # top_k > 256: full sort
             (medium, SamplingParams(top_k=700, top_p=0.2, seed=9)),  # its mass: full sort
             (ties, SamplingParams(top_k=3, seed=6)),  # a tie group at the cut
             (ties, SamplingParams(top_p=0.3, seed=7)),
             (peaked, SamplingParams(temperature=0.9, seed=8))]  # no filter in this row
    check_cases(cases, vocab, calls)


def check_cases(cases: list, vocab: int, calls: list) -> None:
    """Each (logits row, params) case: probabilities and sampled tokens of one batched
    call equal the per-row reference, with both the candidate and the full-sort path
    taken (`calls` records which)."""
    logits = torch.from_numpy(np.stack([c[0] for c in cases]).astype(np.float32))
    states = [SamplerState.create(p, [], vocab) for _, p in cases]
    probs = Sampler().probs(logits, states).numpy()
    assert True in calls and False in calls  # both paths taken
    for row, (_, params), got in zip(logits.numpy(), cases, probs, strict=True):
        ref = reference_probs(row, params, (), ())
        assert set(np.flatnonzero(got)) == set(np.flatnonzero(ref)), params
        np.testing.assert_allclose(got, ref, atol=1e-12)
    streams = [UniformStream(p.seed) for _, p in cases]
    for _ in range(5):
        out = Sampler().sample(logits, states).token_ids
        for i, (_, params) in enumerate(cases):
            assert out[i] == reference_token(logits[i].numpy(), params, (), [], streams[i])
