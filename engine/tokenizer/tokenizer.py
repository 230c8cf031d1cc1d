"""The engine's tokenizer: llama.cpp's `llama_tokenize` / `llama_detokenize` over a GGUF vocab.

`encode` first splits the text around special tokens exactly as llama.cpp's
`tokenizer_st_partition` does (longest token text first, each one over the whole text;
control tokens only with `parse_special`, user-defined ones always; lstrip/rstrip where the
model asks for them), then runs the `tokenizers` pipeline built in `vocab.py` on each piece
of plain text. `decode` concatenates token pieces the way `llama_detokenize` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers

from engine.errors import InvalidRequest
from engine.tokenizer.detok import clean_up_spaces
from engine.tokenizer.specials import HIDDEN_ATTRS, SPECIAL_ATTRS, Attr
from engine.tokenizer.vocab import Vocab, build_hf_tokenizer, parse_vocab, token_pieces

_C_SPACES = frozenset(" \t\n\v\f\r")  # C isspace() in the "C" locale, what llama.cpp strips
_NEWLINE_RUNS = re.compile(r"(\n+)")


@dataclass(frozen=True, slots=True)
class _Special:
    text: str
    token_id: int
    lstrip: bool
    rstrip: bool


class _SpecialMatcher:
    """The special tokens present in a text, in llama.cpp's partition order. Tokens are
    grouped by first character; a text is searched only for the groups whose first character
    it contains, a small group token by token, a large one (gemma's 6K `<unused*>`) with one
    regex over the group's trie."""

    _LARGE_GROUP = 64  # below this, `in` per token is faster than the regex
    _LONG_TOKEN = 128  # longer tokens stay out of the trie regex (nesting depth)

    def __init__(self, specials: list[_Special]) -> None:
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

    def present(self, text: str) -> list[_Special]:
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


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary, token for token as llama.cpp."""

    def __init__(self, vocab: Vocab, hf: tokenizers.Tokenizer) -> None:
        self._vocab = vocab
        self._hf = hf
        self._ids = vocab.ids
        self._pieces = token_pieces(vocab)
        self._visible_pieces = [
            b"" if attr & HIDDEN_ATTRS else piece
            for piece, attr in zip(self._pieces, vocab.attrs, strict=True)
        ]
        self.vocab_size: int = len(vocab.texts)
        self.bos_id: int | None = vocab.bos_id
        self.eos_id: int | None = vocab.eos_id
        self.eog_ids: frozenset[int] = vocab.eog_ids
        self.add_bos: bool = vocab.add_bos
        self.add_eos: bool = vocab.add_eos
        self._newline_words = vocab.pre is not None and vocab.pre.spm_style
        specials = [
            _Special(text, i, bool(attr & Attr.LSTRIP), bool(attr & Attr.RSTRIP))
            for i, (text, attr) in enumerate(zip(vocab.texts, vocab.attrs, strict=True))
            if attr & SPECIAL_ATTRS
        ]
        # llama.cpp sorts by text length, longest first; equal lengths keep id order here.
        specials.sort(key=lambda sp: -len(sp.text))
        self._match_all = _SpecialMatcher(specials)
        self._match_plain = _SpecialMatcher(
            [sp for sp in specials if not vocab.attrs[sp.token_id] & HIDDEN_ATTRS]
        )

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        vocab = parse_vocab(metadata)
        return cls(vocab, build_hf_tokenizer(vocab))

    @property
    def add_space_prefix(self) -> bool:
        return self._vocab.add_space_prefix

    @property
    def clean_spaces(self) -> bool:
        """Whether decode applies llama.cpp's clean_up_tokenization_spaces (" ?" -> "?")."""
        return self._vocab.clean_spaces

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The merge stage alone (no special-token splitting, no BOS/EOS)."""
        return self._hf

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        fragments = self._partition(text, parse_special) if text else []
        ids: list[int] = []
        if add_special and self.add_bos:
            assert self.bos_id is not None  # parse_vocab refuses add_bos without BOS
            ids.append(self.bos_id)
        is_spm = self._vocab.kind == "spm"
        prev_special = True
        for fragment in fragments:
            if isinstance(fragment, int):
                ids.append(fragment)
                prev_special = True
                continue
            if is_spm and self._vocab.add_space_prefix and prev_special:
                fragment = " " + fragment  # SPM: a space before text that starts a segment
            ids += self._encode_text(fragment)
            prev_special = False
        if add_special and self.add_eos:
            assert self.eos_id is not None
            ids.append(self.eos_id)
        return ids

    def _encode_text(self, text: str) -> list[int]:
        if not self._newline_words:
            return self._hf.encode(text, add_special_tokens=False).ids
        # gemma4: a run of newlines that is itself a token is that token, never merged.
        ids: list[int] = []
        for part in _NEWLINE_RUNS.split(text):
            if part[:1] == "\n" and (tid := self._ids.get(part)) is not None:
                ids.append(tid)
            elif part:
                ids += self._hf.encode(part, add_special_tokens=False).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """llama_detokenize(ids, remove_special=skip_special, unparse_special=not skip_special),
        invalid UTF-8 replaced by U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        ids = self._checked(ids)
        remove_space = self._vocab.add_space_prefix
        if skip_special:
            if self.add_bos and ids and ids[0] == self.bos_id:
                ids, remove_space = ids[1:], False
            if self.add_eos and ids and ids[-1] == self.eos_id:
                ids = ids[:-1]
        pieces = self.pieces(skip_special)
        parts = [pieces[i] for i in ids]
        if remove_space and parts and parts[0][:1] == b" ":
            parts[0] = parts[0][1:]
        data = b"".join(parts)
        return clean_up_spaces(data) if self._vocab.clean_spaces else data

    def pieces(self, skip_special: bool = False) -> list[bytes]:
        """Token id -> piece bytes, as llama_token_to_piece(special=not skip_special)."""
        return self._visible_pieces if skip_special else self._pieces

    def token_bytes(self, token_id: int) -> bytes:
        return self._pieces[self._checked([token_id])[0]]

    def token_str(self, token_id: int) -> str:
        return self._vocab.texts[self._checked([token_id])[0]]

    def special_token_id(self, text: str) -> int | None:
        """The id of the control, user-defined or unknown token spelled `text`, else None."""
        tid = self._ids.get(text)
        return tid if tid is not None and self._vocab.attrs[tid] & SPECIAL_ATTRS else None

    def is_special(self, token_id: int) -> bool:
        """Whether decode(skip_special=True) hides the token (control or unknown)."""
        return bool(self._vocab.attrs[self._checked([token_id])[0]] & HIDDEN_ATTRS)

    def _checked(self, ids: Sequence[int]) -> list[int]:
        out = [int(i) for i in ids]
        if out and (min(out) < 0 or max(out) >= self.vocab_size):
            bad = next(i for i in out if not 0 <= i < self.vocab_size)
            raise InvalidRequest(
                f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        matcher = self._match_all if parse_special else self._match_plain
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


def _split_on(text: str, sp: _Special) -> list[str | int]:
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
