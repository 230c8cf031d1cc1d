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
from typing import Any

import tokenizers

from engine.errors import InvalidRequest
from engine.tokenizer.detok import clean_up_spaces
from engine.tokenizer.partition import Special, SpecialMatcher, partition
from engine.tokenizer.specials import HIDDEN_ATTRS, SPECIAL_ATTRS, Attr
from engine.tokenizer.vocab import Vocab, build_hf_tokenizer, parse_vocab, token_pieces

_NEWLINE_RUNS = re.compile(r"(\n+)")
_SURROGATES = re.compile("[\ud800-\udfff]")


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
        self.fim_ids: dict[str, int] = vocab.fim_ids
        self.add_bos: bool = vocab.add_bos
        self.add_eos: bool = vocab.add_eos
        self._newline_words = vocab.pre is not None and vocab.pre.spm_style
        specials = [
            Special(text, i, bool(attr & Attr.LSTRIP), bool(attr & Attr.RSTRIP))
            for i, (text, attr) in enumerate(zip(vocab.texts, vocab.attrs, strict=True))
            if attr & SPECIAL_ATTRS
        ]
        # llama.cpp sorts by text length, longest first; equal lengths keep id order here.
        specials.sort(key=lambda sp: -len(sp.text))
        self._match_all = SpecialMatcher(specials)
        self._match_plain = SpecialMatcher(
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
        """Whether decode applies llama.cpp's clean_up_tokenization_spaces (" ?" -> "?") by
        default."""
        return self._vocab.clean_spaces

    @property
    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The merge stage alone (no special-token splitting, no BOS/EOS)."""
        return self._hf

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if not text:
            fragments: list[str | int] = []
        else:
            matcher = self._match_all if parse_special else self._match_plain
            fragments = partition(_without_surrogates(text), matcher)
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

    def decode(
        self, ids: Sequence[int], skip_special: bool = False, *, clean_spaces: bool | None = None,
    ) -> str:
        """llama_detokenize(ids, remove_special=skip_special, unparse_special=not skip_special),
        invalid UTF-8 replaced by U+FFFD. `clean_spaces=False` skips llama.cpp's clean-up of
        spaces before punctuation (on by default for some BPE vocabularies, e.g. Llama 3's,
        where it turns code like "a ? b" into "a? b"); llama-server streams text without it."""
        return self.decode_bytes(ids, skip_special, clean_spaces=clean_spaces).decode(
            "utf-8", "replace")

    def decode_bytes(
        self, ids: Sequence[int], skip_special: bool = False, *, clean_spaces: bool | None = None,
    ) -> bytes:
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
        if clean_spaces is None:
            clean_spaces = self._vocab.clean_spaces
        return clean_up_spaces(data) if clean_spaces else data

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


def _without_surrogates(text: str) -> str:
    """Unpaired surrogates (from JSON escapes) have no UTF-8 form: each becomes U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", text)
    return text
