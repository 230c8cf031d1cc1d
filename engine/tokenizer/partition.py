"""llama.cpp's special-token partition (`tokenizer_st_partition`), before any merging.

The special tokens (control, user-defined, unknown) are taken longest text first; each one
splits every piece of plain text left by the longer ones at all its occurrences, left to
right. This is not leftmost-longest matching: with tokens "xyz" and "wx", "wxyz" becomes
"w" + <xyz>. Tokens marked lstrip/rstrip (by model, see specials.py) also take the
whitespace before/after them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_C_SPACES = frozenset(" \t\n\v\f\r")  # C isspace() in the "C" locale, what llama.cpp strips


@dataclass(frozen=True, slots=True)
class Special:
    text: str
    token_id: int
    lstrip: bool
    rstrip: bool


class SpecialMatcher:
    """The special tokens present in a text, in llama.cpp's partition order. Tokens are
    grouped by first character; a text is searched only for the groups whose first character
    it contains, a small group token by token, a large one (gemma's 6K `<unused*>`) with one
    regex over the group's trie."""

    _LARGE_GROUP = 64  # below this, `in` per token is faster than the regex
    _LONG_TOKEN = 128  # longer tokens stay out of the trie regex (nesting depth)

    def __init__(self, specials: list[Special]) -> None:
        self.specials = specials
        self.order = {sp.text: i for i, sp in enumerate(specials)}
        groups: dict[str, list[str]] = {}
        for sp in specials:
            groups.setdefault(sp.text[0], []).append(sp.text)
        self.small: list[tuple[str, list[str]]] = []
        self.large: list[tuple[str, re.Pattern[str], frozenset[str]]] = []
        for first, all_texts in groups.items():
            texts = [t for t in all_texts if len(t) <= self._LONG_TOKEN]
            if len(texts) <= self._LARGE_GROUP:
                self.small.append((first, all_texts))
            else:
                long_texts = [t for t in all_texts if len(t) > self._LONG_TOKEN]
                if long_texts:
                    self.small.append((first, long_texts))
                # One match per occurrence of `first` (it is consumed, the rest looked ahead),
                # capturing the longest token there; shorter ones are its prefixes.
                rest = _trie_regex([t[1:] for t in texts])
                self.large.append((first, re.compile(f"{re.escape(first)}(?=({rest}))"),
                                   frozenset(texts)))

    def present(self, text: str) -> list[Special]:
        found: set[str] = set()
        for first, texts in self.small:
            if first in text:
                found.update(t for t in texts if t in text)
        for first, pattern, group in self.large:
            if first in text:
                for longest in {first + m.group(1) for m in pattern.finditer(text)}:
                    found.update(longest[:k] for k in range(1, len(longest) + 1)
                                 if longest[:k] in group)
        return [self.specials[i] for i in sorted(self.order[t] for t in found)]


def _trie_regex(words: list[str]) -> str:
    """A regex matching exactly `words`, shaped as their trie (greedy: longest first)."""
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        branches = [re.escape(ch) + build(child) for ch, child in node.items() if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return build(trie)


def partition(text: str, matcher: SpecialMatcher) -> list[str | int]:
    """`text` as pieces of plain text (str) and special token ids (int), in order."""
    fragments: list[str | int] = [text]
    for sp in matcher.present(text):
        split: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, str) and sp.text in fragment:
                split += _split_on(fragment, sp)
            else:
                split.append(fragment)
        fragments = split
    return fragments


def _split_on(text: str, sp: Special) -> list[str | int]:
    """Every occurrence of `sp` in `text`, left to right, with llama.cpp's lstrip (drop
    spaces before it) and rstrip (drop spaces after it; the search resumes after them)."""
    out: list[str | int] = []
    start, end, width = 0, len(text), len(sp.text)
    while (match := text.find(sp.text, start)) >= 0:
        left_end = match
        if sp.lstrip:
            while left_end > start and text[left_end - 1] in _C_SPACES:
                left_end -= 1
        if left_end > start:
            out.append(text[start:left_end])
        out.append(sp.token_id)
        start = match + width
        if sp.rstrip:
            while start < end and text[start] in _C_SPACES:
                start += 1
    if start < end:
        out.append(text[start:])
    return out
