"""Token-for-token parity with llama.cpp (llama_tokenize / llama_detokenize / token_to_piece)
on 500+ strings, for the vocabularies the engine serves first."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from tokenizer_strings import HAND_WRITTEN, parity_strings

PARITY_VOCABS = ["llama-spm", "llama-bpe", "qwen2", "gemma3"]
STRINGS = parity_strings()


def _first(wrong: list, total: int) -> str:
    text, ours, ref = wrong[0]
    return f"{len(wrong)}/{total} differ; first {text!r}:\n ours {ours}\n ref  {ref}"


def test_enough_strings() -> None:
    assert len(STRINGS) >= 500 and len(set(STRINGS)) >= 500


@pytest.mark.parametrize("parse_special", [False, True])
@pytest.mark.parametrize("name", PARITY_VOCABS)
def test_encode_matches_llama_cpp(name: str, parse_special: bool, vocab_case: Callable) -> None:
    case = vocab_case(name)
    cases = [(text, True) for text in STRINGS] + [(text, False) for text in HAND_WRITTEN]
    wrong = []
    for text, add_special in cases:
        ours = case.ours.encode(text, add_special=add_special, parse_special=parse_special)
        ref = case.ref.tokenize(text, add_special, parse_special)
        if ours != ref:
            wrong.append((text, ours, ref))
    assert not wrong, _first(wrong, len(cases))


@pytest.mark.parametrize("name", [*PARITY_VOCABS, "gpt-2"])
def test_decode_matches_llama_detokenize(name: str, vocab_case: Callable) -> None:
    """Ids of every string (specials parsed) and random id sequences, both skip modes:
    llama_detokenize(remove_special=skip, unparse_special=not skip)."""
    case = vocab_case(name)
    rng = random.Random(7)
    sequences = [case.ref.tokenize(text, True, True) for text in STRINGS]
    sequences += [[rng.randrange(case.ref.n_tokens) for _ in range(rng.randint(1, 12))]
                  for _ in range(300)]
    wrong = []
    for ids in sequences:
        for skip in (False, True):
            ref = case.ref.detokenize(ids, skip, not skip)
            if case.ours.decode_bytes(ids, skip_special=skip) != ref:
                wrong.append((ids, case.ours.decode_bytes(ids, skip_special=skip), ref))
            elif case.ours.decode(ids, skip_special=skip) != ref.decode("utf-8", "replace"):
                wrong.append((ids, case.ours.decode(ids, skip_special=skip), ref))
    assert not wrong, _first(wrong, 2 * len(sequences))


@pytest.mark.parametrize("name", PARITY_VOCABS)
def test_round_trip_where_llama_cpp_round_trips(name: str, vocab_case: Callable) -> None:
    case = vocab_case(name)
    num_round_trips = 0
    for text in STRINGS:
        ids = case.ours.encode(text, add_special=False)
        if case.ref.detokenize(ids, False, True) == text.encode():
            num_round_trips += 1
            assert case.ours.decode(ids) == text, text
    assert num_round_trips >= len(STRINGS) // 2  # the check above must have run


@pytest.mark.parametrize("name", [*PARITY_VOCABS, "gpt-2", "gemma-4"])
def test_vocab_tables_match(name: str, vocab_case: Callable) -> None:
    """Token pieces (with and without special rendering), the EOG set and the BOS/EOS
    settings, as llama.cpp's loader decides them. Pieces: every special and byte token, and
    every third one of the rest."""
    case = vocab_case(name)
    ours, ref = case.ours, case.ref
    assert ours.vocab_size == ref.n_tokens
    shown, hidden = ours.pieces(False), ours.pieces(True)
    texts = case.metadata["tokenizer.ggml.tokens"]
    checked = [i for i, text in enumerate(texts) if i % 3 == 0 or text.startswith("<0x")
               or ours.special_token_id(text) is not None]
    bad_pieces = [i for i in checked
                  if shown[i] != ref.piece(i, True) or hidden[i] != ref.piece(i, False)]
    assert not bad_pieces, f"{len(bad_pieces)} pieces differ, first id {bad_pieces[0]}"
    assert all(ours.token_bytes(i) == shown[i] for i in range(0, ref.n_tokens, 997))
    assert ours.eog_ids == {i for i in range(ref.n_tokens) if ref.is_eog(i)}
    assert (ours.add_bos, ours.add_eos) == (ref.add_bos(), ref.add_eos())
    assert (ours.bos_id, ours.eos_id) == tuple(None if t < 0 else t for t in (ref.bos(), ref.eos()))


@pytest.mark.parametrize("name", PARITY_VOCABS)
def test_special_token_id(name: str, vocab_case: Callable) -> None:
    case = vocab_case(name)
    specials = [t for t in case.metadata["tokenizer.ggml.tokens"]
                if case.ours.special_token_id(t) is not None]
    assert specials
    for text in specials[:60] + specials[-60:]:
        tid = case.ours.special_token_id(text)
        assert case.ours.token_str(tid) == text
        assert case.ref.tokenize(text, False, True) == [tid], text
    assert case.ours.special_token_id("hello") is None
    assert case.ours.special_token_id("not a token at all \u2603") is None


@pytest.mark.parametrize("name", [*PARITY_VOCABS, "deepseek-coder", "gemma-4"])
def test_fill_in_the_middle_tokens(name: str, vocab_case: Callable) -> None:
    """The FIM tokens (what /v1/completions' `suffix` builds its prompt from) are the ones
    llama.cpp's loader finds, and absent where it finds none."""
    import llama_cpp

    case = vocab_case(name)
    ref = {kind: tid for kind in ("pre", "suf", "mid", "pad", "rep", "sep")
           if (tid := getattr(llama_cpp, f"llama_vocab_fim_{kind}")(case.ref.vocab)) >= 0}
    assert case.ours.fim_ids == {f"fim_{k}": t for k, t in ref.items()}
    if name == "deepseek-coder":  # the test files of Qwen keep no added tokens
        assert {"fim_pre", "fim_suf", "fim_mid"} <= case.ours.fim_ids.keys()
