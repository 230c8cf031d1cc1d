"""Sampler against a float64 numpy reference written from the definitions (vLLM/llama.cpp)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from sampler_ref import one_thread, penalized  # noqa: F401 (one_thread: autouse fixture)

from engine.errors import InvalidRequest
from engine.sampler import Sampler, SamplerState, SamplingParams

VOCAB = 120


def reference_probs(logits, params, prompt_ids=(), output_ids=()):
    """The distribution the sampler should draw from, step by step as the docs define it."""
    x = penalized(logits, params, prompt_ids, output_ids)
    if params.temperature == 0 or params.top_k == 1:
        p = np.zeros_like(x)
        p[int(np.flatnonzero(x == x.max())[0])] = 1.0
        return p
    x = x / params.temperature
    p = np.exp(x - x.max())
    p /= p.sum()
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    keep = set(order[: params.top_k] if params.top_k > 0 else order)
    if params.top_p < 1:
        mass = sum(p[i] for i in keep)
        chosen, cum = set(), 0.0
        for i in (i for i in order if i in keep):
            chosen.add(i)
            cum += p[i] / mass
            if cum >= params.top_p:
                break
        keep = chosen
    keep = {i for i in keep if p[i] >= params.min_p * p.max()}
    q = np.array([p[i] if i in keep else 0.0 for i in range(len(p))])
    return q / q.sum()


def random_logits(rng, n=VOCAB, scale=2.0):
    return rng.standard_normal(n).astype(np.float32) * scale


COMBOS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t, k, p, m in itertools.product((0.6, 1.4), (0, 7), (1.0, 0.8), (0.0, 0.1))
]


def short_id(params):
    return f"T{params.temperature}-k{params.top_k}-p{params.top_p}-m{params.min_p}"


@pytest.mark.parametrize("params", COMBOS, ids=short_id)
def test_support_and_probs_match_reference(params):
    rng = np.random.default_rng(1)
    logits = np.stack([random_logits(rng) for _ in range(3)])
    states = [SamplerState.create(params, [], VOCAB) for _ in range(3)]
    got = Sampler().probs(torch.from_numpy(logits), states).numpy()
    for row, probs in zip(logits, got, strict=True):
        ref = reference_probs(row, params)
        assert set(np.flatnonzero(probs)) == set(np.flatnonzero(ref))
        np.testing.assert_allclose(probs, ref, atol=1e-12)


@pytest.mark.parametrize("params", [SamplingParams(top_k=30), SamplingParams(top_p=0.4)],
                         ids=short_id)
def test_ties_at_the_cut_go_to_lower_ids(params):
    logits = np.random.default_rng(8).integers(0, 3, size=(4, VOCAB)).astype(np.float32)
    states = [SamplerState.create(params, [], VOCAB) for _ in range(4)]
    got = Sampler().probs(torch.from_numpy(logits), states).numpy()
    for row, probs in zip(logits, got, strict=True):
        ref = reference_probs(row, params)
        assert set(np.flatnonzero(probs)) == set(np.flatnonzero(ref))
        np.testing.assert_allclose(probs, ref, atol=1e-12)


@pytest.mark.parametrize("params", [COMBOS[5], COMBOS[10], COMBOS[15]], ids=short_id)
def test_empirical_distribution(params):
    """20k draws (2k unseeded rows x 10 steps); each bin within 5 sigma of the reference."""
    rows, steps, n, vocab = 2_000, 10, 20_000, 48
    rng = np.random.default_rng(2)
    row = random_logits(rng, n=vocab, scale=1.0)
    ref = reference_probs(row, params)
    states = [SamplerState.create(params, [], vocab) for _ in range(rows)]
    logits = torch.from_numpy(row).expand(rows, vocab)
    tokens = [t for _ in range(steps) for t in Sampler().sample(logits, states).token_ids]
    counts = np.bincount(tokens, minlength=vocab)
    assert set(np.flatnonzero(counts)) <= set(np.flatnonzero(ref))
    freq = counts / n
    sigma = np.sqrt(ref * (1 - ref) / n)
    assert np.all(np.abs(freq - ref) <= 5 * sigma + 1e-9), np.max(np.abs(freq - ref) / sigma)


def test_greedy_is_argmax_with_ties_to_lowest_id():
    rng = np.random.default_rng(3)
    logits = np.stack([random_logits(rng) for _ in range(4)])
    logits[1, [5, 9, 40]] = logits[1].max() + 1.0  # three-way tie: id 5 wins
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(top_k=1, temperature=2.0),
              SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.5)]
    prompt = [int(np.argmax(logits[3]))]
    states = [SamplerState.create(p, prompt, VOCAB) for p in params]
    tokens = Sampler().sample(torch.from_numpy(logits), states).token_ids
    assert tokens[1] == 5
    for row, p, tok in zip(logits, params, tokens, strict=True):
        x = penalized(row, p, prompt if p.repetition_penalty != 1 else ())
        assert tok == int(np.flatnonzero(x == x.max())[0])


def test_seeded_row_is_batch_invariant():
    target = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=1234)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=5, seed=7),
              SamplingParams(min_p=0.2, presence_penalty=1.0), SamplingParams(logprobs=3),
              SamplingParams(temperature=1.7, frequency_penalty=-0.5, seed=99),
              SamplingParams(top_p=0.3), SamplingParams(temperature=0.3, top_k=40)]
    rng = np.random.default_rng(4)
    steps = [random_logits(rng, scale=1.0) for _ in range(40)]
    prompt = list(range(10))

    def run(batch_params, pos):
        states = [SamplerState.create(p, prompt, VOCAB) for p in batch_params]
        out = []
        for row in steps:
            logits = torch.from_numpy(np.stack([random_logits(rng) for _ in batch_params]))
            logits[pos] = torch.from_numpy(row)
            out.append(Sampler().sample(logits, states).token_ids[pos])
        return out

    alone = run([target], 0)
    assert run(others[:3] + [target] + others[3:], 3) == alone
    assert run([target] + others, 0) == alone
    assert len(set(alone)) > 5  # really sampled, not greedy
    other_seed = run([SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2,
                                     seed=1235)], 0)
    assert other_seed != alone


def test_penalties_match_reference_formula_across_steps():
    rng = np.random.default_rng(5)
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                            frequency_penalty=0.3, temperature=0.8)
    prompt = [1, 2, 3, 3, 50]
    state = SamplerState.create(params, prompt, VOCAB)
    sampler, outputs = Sampler(), []
    for _ in range(6):
        row = random_logits(rng)
        row[[2, 3]] = [-1.5, 2.5]  # a seen negative and a seen positive logit
        ref = reference_probs(row, params, prompt, outputs)
        np.testing.assert_allclose(sampler.probs(torch.from_numpy(row[None]), [state])[0].numpy(),
                                   ref, rtol=1e-10, atol=1e-14)
        token = sampler.sample(torch.from_numpy(row[None]), [state]).token_ids[0]
        outputs.append(token)
        state.record(7)  # a token from elsewhere (e.g. an accepted draft) also counts
        outputs.append(7)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_are_raw_log_softmax(k):
    rng = np.random.default_rng(6)
    logits = np.stack([random_logits(rng, scale=4.0) for _ in range(3)])
    params = [SamplingParams(logprobs=k, temperature=0.5, repetition_penalty=1.5, seed=1),
              SamplingParams(), SamplingParams(logprobs=min(k, 3), temperature=0.0)]
    states = [SamplerState.create(p, [0, 1, 2], VOCAB) for p in params]
    out = Sampler().sample(torch.from_numpy(logits), states)
    assert out.logprobs[1] is None
    for i in (0, 2):
        x = logits[i].astype(np.float64)
        ref = x - x.max() - np.log(np.exp(x - x.max()).sum())
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - ref[lp.token_id]) < 1e-5
        assert [t for t, _ in lp.top] == list(np.argsort(-ref)[: params[i].logprobs])
        np.testing.assert_allclose([v for _, v in lp.top], ref[[t for t, _ in lp.top]], atol=1e-5)


def test_logit_bias_after_penalties_in_every_path():
    """The bias moves the distribution (reference: penalties, then the bias), forces and bans
    tokens in greedy rows, the plain-greedy fast path's included, and leaves logprobs raw."""
    rng = np.random.default_rng(9)
    bias = ((3, 5.0), (17, -100.0), (60, 2.5))
    params = SamplingParams(temperature=0.9, top_k=20, presence_penalty=0.5, logit_bias=bias,
                            logprobs=2, seed=4)
    state, outputs, sampler = SamplerState.create(params, [1, 2], VOCAB), [], Sampler()
    for _ in range(4):
        row = random_logits(rng)
        row[17] = 50.0  # banned: never drawn however likely
        ref = reference_probs(row, params, [1, 2], outputs)
        got = sampler.probs(torch.from_numpy(row[None]), [state])[0].numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-14)
        out = sampler.sample(torch.from_numpy(row[None]), [state])
        assert out.token_ids[0] != 17 and out.logprobs[0].top[0][0] == 17  # raw logprobs
        outputs.append(out.token_ids[0])
    logits = torch.from_numpy(np.stack([random_logits(rng) for _ in range(3)]))
    greedy = [SamplingParams(temperature=0.0, logit_bias=((5, 100.0),)),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logit_bias=((int(logits[2].argmax()), -100.0),))]
    states = [SamplerState.create(p, [], VOCAB) for p in greedy]
    tokens = sampler.sample(logits, states).token_ids
    assert tokens[0] == 5 and tokens[1] == int(logits[1].argmax())
    assert tokens[2] == int(logits[2].topk(2).indices[1])
    only = SamplerState.create(greedy[0], [], VOCAB)  # alone: the plain-greedy batch path
    assert not only.is_plain_greedy and only.is_stateless
    assert sampler.sample(logits[:1], [only]).token_ids == [5]


class SetGrammar:
    def __init__(self, allowed):
        self.allowed, self.accepted = set(allowed), []

    def allowed_mask(self, vocab_size):
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[list(self.allowed)] = True
        return mask

    def accept(self, token_id):
        self.accepted.append(token_id)

    def is_finished(self):
        return False


def test_grammar_mask_respected_and_accepted():
    rng = np.random.default_rng(7)
    allowed = {3, 17, 60, 61, 99}
    grammars = [SetGrammar(allowed) for _ in range(300)]
    params = [SamplingParams(temperature=2.0, grammar=g, seed=i) for i, g in enumerate(grammars)]
    params[0] = SamplingParams(temperature=0.0, grammar=grammars[0])
    states = [SamplerState.create(p, [], VOCAB) for p in params]
    logits = np.stack([random_logits(rng) for _ in states])
    tokens = Sampler().sample(torch.from_numpy(logits), states).token_ids
    assert set(tokens) <= allowed and len(set(tokens)) > 2
    assert tokens[0] == max(allowed, key=lambda i: logits[0, i])
    assert [g.accepted for g in grammars] == [[t] for t in tokens]
    ref = reference_probs(np.where(np.isin(np.arange(VOCAB), list(allowed)), logits[1], -np.inf),
                          params[1])
    np.testing.assert_allclose(Sampler().probs(torch.from_numpy(logits[1:2]), states[1:2])[0],
                               ref, atol=1e-12)
    with pytest.raises(InvalidRequest):
        state = SamplerState.create(SamplingParams(grammar=SetGrammar(())), [], VOCAB)
        Sampler().sample(torch.from_numpy(logits[:1]), [state])


def test_record_false_leaves_state_alone():
    grammar = SetGrammar(range(VOCAB))
    state = SamplerState.create(SamplingParams(grammar=grammar, presence_penalty=2.0), [], VOCAB)
    logits = torch.zeros(1, VOCAB)
    Sampler().sample(logits, [state], record=False)
    assert grammar.accepted == [] and state.num_output_tokens == 0
    assert torch.equal(Sampler().probs(logits, [state])[0], torch.full((VOCAB,), 1 / VOCAB,
                                                                         dtype=torch.float64))


@pytest.mark.parametrize("bad", [
    dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=1.1),
    dict(repetition_penalty=0.0), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
    dict(logprobs=21), dict(temperature=float("nan")), dict(logit_bias=((1, 100.5),)),
    dict(logit_bias=((1, float("nan")),)), dict(logit_bias=((VOCAB, 1.0),)),
    dict(logit_bias=((-1, 1.0),)),
])
def test_out_of_range_params_rejected(bad):
    with pytest.raises(InvalidRequest):
        SamplerState.create(SamplingParams(**bad), [], VOCAB)


def test_unseeded_sequences_differ():
    logits = torch.zeros(1, VOCAB)
    runs = []
    for _ in range(2):
        state = SamplerState.create(SamplingParams(), [], VOCAB)
        runs.append([Sampler().sample(logits, [state]).token_ids[0] for _ in range(20)])
    assert runs[0] != runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device")
def test_device_rows_match_cpu_rows():
    """Same seeds on CPU and GPU: same tokens (the draws come from CPU generators)."""
    vocab = 50_000
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=1, logprobs=5),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(top_k=40, min_p=0.05, presence_penalty=0.7, seed=2,
                             logit_bias=((7, 3.0), (11, -100.0))),
              SamplingParams(temperature=1.2, seed=3, grammar=SetGrammar(range(0, vocab, 3)))]
    runs = {}
    for device in ("cpu", "cuda"):
        states = [SamplerState.create(p, list(range(20)), vocab) for p in params]
        if params[3].grammar is not None:
            params[3].grammar.accepted.clear()
        rng = np.random.default_rng(9)
        tokens, logprobs = [], []
        for _ in range(20):
            logits = torch.from_numpy(rng.standard_normal((4, vocab)).astype(np.float32) * 3)
            out = Sampler().sample(logits.to(device), states)
            tokens.append(out.token_ids)
            logprobs.append(out.logprobs[0].logprob)
        runs[device] = tokens, logprobs
    assert runs["cpu"][0] == runs["cuda"][0]
    np.testing.assert_allclose(runs["cpu"][1], runs["cuda"][1], atol=1e-5)
