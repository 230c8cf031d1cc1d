"""Top-k/top-p on the CPU for vocabularies of 512 ids and up: the candidate filter looks at
an eighth of the vocabulary first (64 ids at 512) and must match the reference, whether a
row's support ends inside the candidates or the row takes the full sort."""

from __future__ import annotations

import numpy as np
import pytest
from sampler_ref import one_thread  # noqa: F401 (autouse fixture)
from test_sampler_batched import check_cases

import engine.sampler_filters as filters_module
from engine.sampler import SamplingParams


@pytest.mark.parametrize("vocab", [512, 600, 1024])
def test_small_vocab_candidates_match_reference(monkeypatch, vocab):
    calls = []
    original = filters_module.top_k_top_p
    monkeypatch.setattr(filters_module, "top_k_top_p", lambda *a, **k: calls.append(
        k.get("full_sort", False)) or original(*a, **k))
    rng = np.random.default_rng(vocab)
    peaked = rng.standard_normal(vocab) * 4
    flat = rng.standard_normal(vocab) * 0.05
    ties = np.floor(rng.standard_normal(vocab) * 2) * 2
    cases = [(peaked, SamplingParams(temperature=0.8, top_p=0.95, seed=1)),
             (peaked, SamplingParams(top_k=20, top_p=0.9, seed=2)),
             (flat, SamplingParams(top_p=0.9, seed=3)),  # the nucleus is most ids: full sort
             (peaked, SamplingParams(top_k=vocab // 4, seed=4)),  # past the candidates
             (ties, SamplingParams(top_p=0.3, seed=5)),
             (peaked, SamplingParams(temperature=0.9, seed=6))]
    check_cases(cases, vocab, calls)
