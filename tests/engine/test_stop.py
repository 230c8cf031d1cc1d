"""StopChecker against hand cases and a brute-force reference over whole texts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequest
from engine.stop import StopChecker

EOG = frozenset({2})


def run(deltas, stop=(), stop_ids=(), ignore_eos=False, max_tokens=None, token_ids=None):
    """Feed deltas; returns (list of emitted pieces, finish_reason, stop_reason, tokens fed)."""
    checker = StopChecker(stop, stop_ids, EOG, ignore_eos, max_tokens)
    token_ids = token_ids or [100 + i for i in range(len(deltas))]
    pieces = []
    for n, (tok, delta) in enumerate(zip(token_ids, deltas, strict=True), start=1):
        update = checker.feed(tok, delta)
        pieces.append(update.text)
        if update.finish_reason is not None:
            return pieces, update.finish_reason, update.stop_reason, n
    return pieces + [checker.flush()], None, None, len(deltas)


def test_stop_string_split_across_deltas():
    pieces, reason, which, n = run(["Hello <", "/e", "nd> more", "never"], stop=["</end>"])
    assert "".join(pieces) == "Hello " and (reason, which, n) == ("stop", "</end>", 3)
    assert pieces[0] == "Hello "  # "<" held back: it may start "</end>"


def test_holdback_released_when_the_match_fails():
    pieces, reason, _, _ = run(["ab", "x", "yb"], stop=["bc"])
    assert pieces == ["a", "bx", "y", "b"] and reason is None  # last "b" came from flush()


def test_first_of_several_stop_strings_wins():
    pieces, reason, which, _ = run(["hello wor", "ld"], stop=["world", "lo w"])
    assert "".join(pieces) == "hel" and which == "lo w"
    pieces, _, which, _ = run(["say ", "abcd"], stop=["bcd", "abcd"])
    assert "".join(pieces) == "say " and which == "abcd"


def test_holdback_released_at_max_tokens():
    pieces, reason, _, n = run(["foo <", "/e", "x"], stop=["</end>"], max_tokens=2)
    assert pieces == ["foo ", "</e"] and (reason, n) == ("length", 2)


def test_stop_beats_length_on_the_same_token():
    _, reason, _, _ = run(["a", "STOP"], stop=["STOP"], max_tokens=2)
    assert reason == "stop"
    pieces, reason, which, _ = run(["a", "b"], token_ids=[5, 2], max_tokens=2)
    assert (pieces, reason, which) == (["a", ""], "stop", 2)


def test_eog_and_ignore_eos():
    pieces, reason, which, _ = run(["x<", "</s>", "y"], stop=["<z"], token_ids=[7, 2, 8])
    assert (pieces, reason, which) == (["x", "<"], "stop", 2)  # EOG text never emitted
    pieces, reason, _, _ = run(["x", "</s>", "y"], token_ids=[7, 2, 8], ignore_eos=True)
    assert "".join(pieces) == "x</s>y" and reason is None
    pieces, reason, which, _ = run(["x", "</s>", "y"], token_ids=[7, 2, 9], ignore_eos=True,
                                   stop_ids=[9])
    assert ("".join(pieces), reason, which) == ("x</s>", "stop", 9)


def test_invalid_max_tokens_and_feed_after_finish():
    with pytest.raises(InvalidRequest):
        StopChecker([], [], EOG, False, 0)
    checker = StopChecker([], [], EOG, False, 1)
    assert checker.feed(5, "a").finish_reason == "length"
    with pytest.raises(AssertionError):
        checker.feed(6, "b")


def reference(deltas, stops, max_tokens):
    """Whole-text reference: after token i, the stream so far is the text minus the longest
    suffix that starts a stop string; the first token whose text holds a stop string ends it."""
    text = ""
    emitted_after = []
    for i, delta in enumerate(deltas, start=1):
        text += delta
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            return text[: min(hits)[0]], "stop", emitted_after
        if max_tokens is not None and i >= max_tokens:
            return text, "length", emitted_after
        hold = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
                   default=0)
        emitted_after.append(text[: len(text) - hold])
    return text, None, emitted_after


@settings(max_examples=200, deadline=None)
@given(
    deltas=st.lists(st.text(alphabet="abc", max_size=4), min_size=1, max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=3),
    max_tokens=st.one_of(st.none(), st.integers(1, 12)),
)
def test_matches_whole_text_reference(deltas, stops, max_tokens):
    final, reason, prefixes = reference(deltas, stops, max_tokens)
    checker = StopChecker(stops, [], EOG, False, max_tokens)
    streamed, got_reason = "", None
    for i, delta in enumerate(deltas):
        update = checker.feed(100, delta)
        streamed += update.text
        got_reason = update.finish_reason
        if got_reason is not None:
            break
        assert streamed == prefixes[i]  # no more held back than necessary, nothing too early
    if got_reason is None:
        streamed += checker.flush()
    assert (streamed, got_reason) == (final, reason)
