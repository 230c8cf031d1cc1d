"""Structured output through llguidance: JSON mode and JSON-schema grammars.

`GrammarTokenizer` adapts a model's Tokenizer to llguidance once per model (building
llguidance's token trie takes seconds for a 262K vocabulary, so it is cached); a
`JsonGrammar` is one sequence's matcher state and implements engine.sampling_params.Grammar.
The sampler asks `allowed_mask` before every draw and calls `accept` with the drawn token.

A grammar must never leave the sampler with no allowed token (the sampler would fail the
whole step): once the matcher is stopped or in an error state, only the end-of-generation
ids are allowed, so the sequence ends.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import numpy as np
import torch

from engine.errors import InvalidRequest
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_SCHEMA_CHARS = 1 << 18  # a schema larger than this is refused before compiling


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads: piece bytes per id, EOS/BOS, specials, and
    a tokenize function whose tokens spell exactly the bytes given (no SPM space prefix,
    no BOS), which llguidance relies on."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = tokenizer.pieces()
        self.special_token_ids = [i for i in range(tokenizer.vocab_size)
                                  if tokenizer.is_special(i)]
        specials = set(self.special_token_ids)
        self._ids: dict[bytes, int] = {}
        for i, piece in enumerate(self.tokens):
            if piece and i not in specials:
                self._ids.setdefault(piece, i)
        self._longest = max((len(p) for p in self._ids), default=1)

    def __call__(self, data: bytes | str) -> list[int]:
        raw = data.encode("utf-8") if isinstance(data, str) else data
        text = raw.decode("utf-8", "replace")
        ids = self._tokenizer.hf_tokenizer.encode(text, add_special_tokens=False).ids
        if b"".join(self.tokens[i] for i in ids) == raw:
            return ids
        return self._greedy(raw)

    def _greedy(self, raw: bytes) -> list[int]:
        """Longest piece first at each position; bytes no piece spells are skipped."""
        out, pos = [], 0
        while pos < len(raw):
            for size in range(min(self._longest, len(raw) - pos), 0, -1):
                token = self._ids.get(raw[pos:pos + size])
                if token is not None:
                    out.append(token)
                    pos += size
                    break
            else:
                pos += 1
        return out


class GrammarTokenizer:
    """llguidance's view of one model's vocabulary."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        import llguidance

        self.eog_ids = sorted(tokenizer.eog_ids)
        if not self.eog_ids:
            raise InvalidRequest("the model has no end-of-generation token: no grammar")
        self.view = _TokenizerView(tokenizer)
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(self.view),
                                         n_vocab=tokenizer.vocab_size, eos_token=self.eog_ids)


_cache: dict[int, tuple[Tokenizer, GrammarTokenizer]] = {}
_cache_lock = threading.Lock()


def grammar_tokenizer(tokenizer: Tokenizer) -> GrammarTokenizer:
    """The cached GrammarTokenizer of `tokenizer` (built on first use; seconds)."""
    with _cache_lock:
        hit = _cache.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        built = GrammarTokenizer(tokenizer)
        _cache[id(tokenizer)] = (tokenizer, built)
        return built


def forget_tokenizer(tokenizer: Tokenizer) -> None:
    """Drop the cached adapter of an unloaded model's tokenizer."""
    with _cache_lock:
        _cache.pop(id(tokenizer), None)


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """llguidance grammar text for a JSON schema (None: any JSON object, OpenAI's JSON mode)."""
    import llguidance

    schema = {"type": "object"} if schema is None else schema
    try:
        text = json.dumps(schema)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the JSON schema cannot be serialized: {exc}") from exc
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequest(f"the JSON schema has {len(text)} characters; at most "
                             f"{MAX_SCHEMA_CHARS} are accepted")
    try:
        # Compact JSON: with free whitespace between tokens a small model can loop on
        # newlines forever; a schema's own "x-guidance" options still take precedence.
        return llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False})
    except ValueError as exc:
        raise InvalidRequest(f"invalid JSON schema: {exc}") from exc


# A thinking model's reasoning before what a grammar asks for (its template's <think> tags):
# "none" (the prompt closed it: Qwen3 without thinking), "optional" (the model may open a
# block first), "open" (the prompt opened it: DeepSeek-R1); the reasoning is free text up
# to "</think>", then blank space
THINK_MODES = ("none", "optional", "open")
_THINK_RULES = ('think_block: "<think>" think /[ \\n]*/\n'
                'think[stop="</think>"]: /(.|\\n)*/\n')


def lark_grammar(body: str, rules: str = "", thinking: str = "none") -> str:
    """llguidance grammar text whose start is the rule expression `body` (with `rules`),
    after the reasoning `thinking` allows."""
    if thinking not in THINK_MODES:
        raise InvalidRequest(f"thinking must be one of {THINK_MODES}, got {thinking!r}")
    start = {"none": body, "optional": f"think_block? ({body})",
             "open": f"think /[ \\n]*/ ({body})"}[thinking]
    return f"%llguidance {{}}\nstart: {start}\n{rules}" + (
        _THINK_RULES if thinking != "none" else "")


def json_body(schema: dict[str, Any] | None) -> str:
    """The `%json {...}` expression of a schema (None: any object), compact as
    json_schema_grammar's."""
    schema = {"type": "object"} if schema is None else schema
    try:
        text = json.dumps({"x-guidance": {"whitespace_flexible": False}, **schema})
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequest(f"the JSON schema cannot be serialized: {exc}") from exc
    if len(text) > MAX_SCHEMA_CHARS:
        raise InvalidRequest(f"the JSON schema has {len(text)} characters; at most "
                             f"{MAX_SCHEMA_CHARS} are accepted")
    return f"%json {text}"


class JsonGrammar:
    """One sequence's matcher; implements engine.sampling_params.Grammar."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer.ll)
        if error and not error.startswith("WARNING"):
            raise InvalidRequest(f"invalid JSON schema: {error}")
        self._tokenizer = tokenizer
        self._matcher = llguidance.LLMatcher(tokenizer.ll, grammar, log_level=0)
        if self._matcher.is_error():
            raise InvalidRequest(f"invalid JSON schema: {self._matcher.get_error()}")
        self._failed = False

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        """(vocab_size,) bool; never all False (end-of-generation ids as the way out)."""
        m = self._matcher
        if self._failed or m.is_error():
            return self._fallback(vocab_size)
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8),
                             bitorder="little")
        n = min(vocab_size, bits.shape[0])
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[:n] = torch.from_numpy(bits[:n].astype(np.bool_))
        if not bool(mask.any()):
            return self._fallback(vocab_size)
        return mask

    def _fallback(self, vocab_size: int) -> torch.Tensor:
        if not self._failed:
            self._failed = True
            log.warning("grammar matcher stopped allowing tokens (%s); ending the sequence",
                        self._matcher.get_error() or self._matcher.stop_reason())
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        ids = [i for i in self._tokenizer.eog_ids if i < vocab_size]
        mask[ids] = True
        return mask

    def accept(self, token_id: int) -> None:
        if not self._failed and not self._matcher.is_error():
            self._matcher.consume_token(int(token_id))

    def is_finished(self) -> bool:
        return self._matcher.is_accepting() or self._matcher.is_stopped()
