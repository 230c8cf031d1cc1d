"""IncrementalDetokenizer: one token at a time it yields exactly decode(all ids), holds back
no more than an unfinished UTF-8 character (plus, with llama.cpp's space clean-up, the bytes
a clean-up rule may still change), and never emits half a character."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from tokenizer_strings import STREAM_STRINGS

from engine.errors import InvalidRequest
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.tokenizer.detok import clean_up_spaces


def _stream(tok: Tokenizer, ids: list[int], skip_special: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special=skip_special)
    return [detok.push(i) for i in ids] + [detok.flush()]


def _is_byte_token(tok: Tokenizer, token_id: int) -> bool:
    text = tok.token_str(token_id)
    return len(text) == 6 and text.startswith("<0x") and text.endswith(">")


@pytest.mark.parametrize("name", ["llama-spm", "gemma3"])
def test_spm_byte_fallback_streams_whole_characters(name: str, vocab_case: Callable) -> None:
    tok = vocab_case(name).ours
    num_split_chars = 0
    for text in STREAM_STRINGS:
        ids = tok.encode(text)
        num_split_chars += sum(_is_byte_token(tok, i) for i in ids)
        for skip in (False, True):
            outputs = _stream(tok, ids, skip)
            assert "".join(outputs) == tok.decode(ids, skip_special=skip), text
            assert not any("\ufffd" in out for out in outputs), text
        # After each token, everything that forms whole characters has come out.
        detok, emitted, raw = IncrementalDetokenizer(tok), "", b""
        for k, tid in enumerate(ids):
            emitted += detok.push(tid)
            raw = tok.decode_bytes(ids[: k + 1])
            held = raw[len(emitted.encode()):]
            assert raw.startswith(emitted.encode()) and len(held) < 4, (text, k)
            assert not held or held[0] >= 0xC0, (text, k)  # only a started character waits
    assert num_split_chars >= 30  # characters spelled in byte tokens were exercised


@pytest.mark.parametrize("name", ["llama-spm", "gemma3", "qwen2", "llama-bpe", "gpt-2"])
def test_random_ids_stream_equals_decode(name: str, vocab_case: Callable) -> None:
    """Arbitrary id sequences: lone bytes, partial characters, control tokens, BOS/EOS."""
    tok = vocab_case(name).ours
    rng = random.Random(11)
    byte_ids = [i for i in range(min(tok.vocab_size, 300)) if _is_byte_token(tok, i)]
    pool = byte_ids + sorted(tok.eog_ids) + [x for x in (tok.bos_id, tok.eos_id) if x is not None]
    for _ in range(300):
        ids = [rng.choice(pool) if pool and rng.random() < 0.5 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 16))]
        for skip in (False, True):
            assert "".join(_stream(tok, ids, skip)) == tok.decode(ids, skip_special=skip), ids


@pytest.mark.parametrize("name", ["llama-bpe", "gpt-2"])
def test_clean_up_spaces_streams_like_llama_detokenize(name: str, vocab_case: Callable) -> None:
    """These vocabularies clean up spaces (" ?" -> "?", " 's" -> "'s", " ' " -> "'"): pieces
    drawn from the bytes the rules look at, streamed, against llama_detokenize."""
    case = vocab_case(name)
    tok = case.ours
    assert tok.clean_spaces
    atoms = [" ", "  ", "'", " '", "s", "m", "re", "ve", "?", "!", ".", ",", "a", "x", "é", "日"]
    atom_ids = {a: tok.encode(a, add_special=False) for a in atoms}
    rng = random.Random(5)
    num_cleaned = 0
    for _ in range(400):
        ids = [i for _ in range(rng.randint(1, 14)) for i in atom_ids[rng.choice(atoms)]]
        want = case.ref.detokenize(ids, False, True)
        num_cleaned += want != b"".join(tok.pieces()[i] for i in ids)
        assert "".join(_stream(tok, ids, False)) == want.decode("utf-8", "replace"), ids
    assert num_cleaned >= 100  # the clean-up rules fired


@pytest.mark.parametrize("skip_special", [False, True])
def test_without_clean_up_pieces_are_concatenated(skip_special: bool,
                                                  vocab_case: Callable) -> None:
    """clean_spaces=False: the plain concatenation of llama_token_to_piece, streamed alike."""
    case = vocab_case("llama-bpe")
    tok, ref = case.ours, case.ref
    for text in ["a ? b : c", "it 's", "x , y . z", " ' ", "<|begin_of_text|>Hi !"]:
        ids = tok.encode(text, parse_special=True)
        want = b"".join(ref.piece(i, not skip_special) for i in ids).decode("utf-8", "replace")
        assert tok.decode(ids, skip_special, clean_spaces=False) == want
        detok = IncrementalDetokenizer(tok, skip_special, clean_spaces=False)
        assert "".join(detok.push(i) for i in ids) + detok.flush() == want
        assert tok.decode(ids, skip_special) != want or " " not in text  # cleaned by default


def test_clean_up_spaces_rules() -> None:
    assert clean_up_spaces(b"a ? b ! c . d , e") == b"a? b! c. d, e"
    assert clean_up_spaces(b"rock ' n ' roll") == b"rock'n'roll"
    assert clean_up_spaces(b"it 's I 'm we 're you 've he 'd they 'll") == (
        b"it's I'm we're you've he 'd they 'll")
    assert clean_up_spaces(b" ' ' ") == b"'' "


def test_out_of_range_ids_raise(vocab_case: Callable) -> None:
    tok = vocab_case("llama-spm").ours
    with pytest.raises(InvalidRequest):
        IncrementalDetokenizer(tok).push(tok.vocab_size)
    with pytest.raises(InvalidRequest):
        tok.decode([0, -1])
    with pytest.raises(InvalidRequest):
        tok.token_bytes(tok.vocab_size + 5)
