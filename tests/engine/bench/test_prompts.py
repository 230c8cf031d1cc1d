"""Salted prompts: fresh, exact token counts with a tokenizer, calibrated sizes without."""

from __future__ import annotations

import asyncio

import pytest
from bench_fakes import BOS, WordTokenizer

from engine.bench.prompts import KV_QUALITY_TEXTS, PromptFactory
from engine.bench.target import Target


@pytest.fixture(scope="module")
def spm_tokenizer(vocab_dir):
    from engine.gguf import ModelFile
    from engine.tokenizer import Tokenizer

    with ModelFile.open(vocab_dir / "ggml-vocab-llama-spm.gguf") as mf:
        return Tokenizer.from_metadata(mf.metadata)


@pytest.mark.parametrize("make_tokenizer", ["words", "spm"])
def test_exact_counts_and_fresh_openers(make_tokenizer, request):
    tok = WordTokenizer() if make_tokenizer == "words" else request.getfixturevalue(
        "spm_tokenizer")
    factory = PromptFactory(11, tok)
    twin = PromptFactory(11)  # same seed, no tokenizer: yields the same salted words
    sizes = [2, 3, 17, 48, 511, 2048] + [40] * 60
    prompts = [factory.make(n) for n in sizes]
    for n, p in zip(sizes, prompts, strict=True):
        assert len(p.ids) == n
        assert p.ids[0] == (BOS if make_tokenizer == "words" else tok.bos_id)
        # the ids are the tokenizer's own encoding of the salted words, cut to n
        words = twin.words(n)
        assert list(p.ids) == tok.encode(words, add_special=True, parse_special=False)[:n]
    # no two prompts share their first token after the BOS (different openers)
    seconds = [p.ids[1] for p in prompts]
    assert len(set(seconds)) == len(seconds)


def test_same_seed_same_prompts_other_seed_other_prompts():
    a = [PromptFactory(5, WordTokenizer()).make(30) for _ in range(1)]
    b = [PromptFactory(5, WordTokenizer()).make(30) for _ in range(1)]
    c = [PromptFactory(6, WordTokenizer()).make(30) for _ in range(1)]
    assert a == b and a != c


def test_openers_come_round_with_an_extra_word():
    factory = PromptFactory(1)
    texts = [factory.words(3) for _ in range(400)]
    assert len({t.split()[0] for t in texts[:325]}) == 325
    assert all(len(t.split()) == 4 for t in texts[325:])


class CountingTarget(Target):
    """Says a text has 1 BOS + 1.5 tokens per word; the factory must learn the ratio."""

    async def complete(self, prompt, max_tokens, *, client="bench"):
        raise AssertionError("calibration sends no streamed request")

    async def count_tokens(self, text: str) -> int:
        return 1 + round(1.5 * len(text.split()))


def test_calibrated_word_counts_without_a_tokenizer():
    factory = asyncio.run(PromptFactory.for_target(CountingTarget(), seed=2))
    assert factory.tokens_per_word == pytest.approx(601 / 400)
    prompt = factory.make(300)
    assert prompt.ids is None
    assert len(prompt.text.split()) == round(300 / (601 / 400))


def test_kv_quality_texts_reach_400_tokens(spm_tokenizer):
    for text in KV_QUALITY_TEXTS:
        assert len(spm_tokenizer.encode(text)) >= 400
