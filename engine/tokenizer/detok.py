"""Streaming detokenization: text as tokens arrive, equal in the end to `Tokenizer.decode`.

A token's piece can end inside a UTF-8 character (byte-fallback tokens, byte-level BPE
pieces), and llama.cpp's clean-up of spaces (" ?" -> "?", " 's" -> "'s") looks up to three
bytes ahead. The detokenizer therefore holds back the bytes whose meaning is not settled yet:
an incomplete character in the UTF-8 decoder, and, where the clean-up applies, the few bytes
after the last point where no clean-up rule can reach across (see `_safe_cut`).
"""

from __future__ import annotations

import codecs
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer

# llama.cpp's three clean-up passes (llama_vocab::impl::detokenize with clean_spaces), each
# a left-to-right rewrite that reads the original bytes of its input:
#   1. drop a space before ? ! . ,
#   2. " ' " -> "'"
#   3. drop a space before 's 'm 're 've
_PASS1 = re.compile(rb" (?=[?!.,])")
_PASS2 = re.compile(rb" ' ")
_PASS3 = re.compile(rb" (?='(?:[sm]|re|ve))")
_SAFE_GAP = 3
_MATCH_TAIL = b"?!.,' smrve"  # the bytes a match can hold after its leading space


def clean_up_spaces(data: bytes) -> bytes:
    return _PASS3.sub(b"", _PASS2.sub(b"'", _PASS1.sub(b"", data)))


class IncrementalDetokenizer:
    """Feeds token ids one at a time; the concatenation of everything `push` and `flush`
    return equals `tokenizer.decode(all_ids, skip_special, clean_spaces=clean_spaces)`."""

    def __init__(
        self, tokenizer: Tokenizer, skip_special: bool = False, *,
        clean_spaces: bool | None = None, continuation: bool = False,
    ) -> None:
        """continuation: the tokens continue a text (a completion after its prompt), so the
        first one keeps its leading space (SPM vocabularies strip it at a text's start)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._pieces = tokenizer.pieces(skip_special)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._clean = tokenizer.clean_spaces if clean_spaces is None else clean_spaces
        self._remove_space = tokenizer.add_space_prefix
        self._is_first = not continuation
        self._pending = b""  # bytes the clean-up may still change
        self._held_eos = b""  # decode(skip_special) drops a final EOS; held until not final

    def push(self, token_id: int) -> str:
        tok = self._tokenizer
        if not 0 <= token_id < tok.vocab_size:
            tok.token_bytes(token_id)  # raises the tokenizer's out-of-range error
        piece = self._pieces[token_id]
        if self._is_first:
            self._is_first = False
            if self._skip_special and tok.add_bos and token_id == tok.bos_id:
                self._remove_space = False
                return ""
            if self._remove_space and piece[:1] == b" ":
                piece = piece[1:]
        data, self._held_eos = self._held_eos, b""
        if self._skip_special and tok.add_eos and token_id == tok.eos_id:
            self._held_eos = piece
        else:
            data += piece
        return self._emit(data, final=False)

    def flush(self) -> str:
        """The rest of the text (a dangling partial character comes out as U+FFFD)."""
        self._held_eos = b""
        return self._emit(b"", final=True)

    def _emit(self, data: bytes, final: bool) -> str:
        if not self._clean:
            return self._decoder.decode(data, final=final)
        self._pending += data
        if final:
            ready, self._pending = self._pending, b""
        else:
            cut = _safe_cut(self._pending)
            ready, self._pending = self._pending[:cut], self._pending[cut:]
        return self._decoder.decode(clean_up_spaces(ready), final=final)


def _safe_cut(data: bytes) -> int:
    """The longest prefix of `data` that the clean-up can process on its own: no match may
    cross the cut. Every match starts with a space, is at most 4 bytes long and reads only
    bytes of `_MATCH_TAIL` after its space, and the passes delete only spaces. So a cut is
    safe with no space among the 3 bytes before it, or before any byte not in
    `_MATCH_TAIL` (that byte survives every pass and can continue no match)."""
    if b" " not in data[-_SAFE_GAP:]:
        return len(data)
    return max(0, len(data.rstrip(_MATCH_TAIL)) - 1)
