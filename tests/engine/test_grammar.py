"""engine/grammar.py: the llguidance adapter.

The tokenize function llguidance calls must spell exactly the bytes given (checked by
joining piece bytes, for SPM, BPE and Gemma vocabularies); a JSON-schema grammar's masks
must allow every token of a document the schema accepts and refuse one it does not;
a matcher that stops allowing tokens leaves only end-of-generation ids, never nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.errors import InvalidRequest
from engine.gguf import ModelFile
from engine.grammar import JsonGrammar, grammar_tokenizer, json_schema_grammar
from engine.tokenizer import Tokenizer

TEXTS = ["a", " a", "{\"k\": [1, 2.5, null]}", "  leading", "tab\there\n", "ünïcödé ✓",
         "東京", "🦊 emoji", "<s> not special", "\u00a0nbsp", "x" * 200]
SCHEMA = {"type": "object", "required": ["n", "tag"], "additionalProperties": False,
          "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "b"]}}}


def _tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_metadata(ModelFile.open(path).metadata)


@pytest.fixture(scope="module", params=["llama-spm", "llama-bpe", "gemma"])
def tokenizer(request, vocab_dir: Path, default_model_path: Path) -> Tokenizer:
    if request.param == "gemma":
        return _tokenizer(default_model_path)
    return _tokenizer(vocab_dir / f"ggml-vocab-{request.param}.gguf")


def test_tokenize_spells_exactly_the_bytes(tokenizer):
    view = grammar_tokenizer(tokenizer).view
    for text in TEXTS:
        for data in (text.encode(), text):
            ids = view(data)
            assert b"".join(view.tokens[i] for i in ids) == text.encode(), text
    greedy = view._greedy(b"hello world")  # the fallback path, on its own
    assert greedy and b"".join(view.tokens[i] for i in greedy) == b"hello world"


def _allowed(grammar: JsonGrammar, vocab: int) -> torch.Tensor:
    mask = grammar.allowed_mask(vocab)
    assert mask.shape == (vocab,) and mask.dtype == torch.bool and bool(mask.any())
    return mask


def test_schema_masks_follow_the_document(tokenizer):
    vocab = tokenizer.vocab_size + 7  # logits wider than the vocabulary (padding rows)
    gtok = grammar_tokenizer(tokenizer)
    text = json_schema_grammar(SCHEMA)
    good = json.dumps({"n": 42, "tag": "b"}, separators=(",", ":"))
    grammar = JsonGrammar(gtok, text)
    for token in gtok.view(good):
        mask = _allowed(grammar, vocab)
        assert mask[token], (good, token)
        assert not mask[tokenizer.vocab_size:].any()
        grammar.accept(token)
    assert grammar.is_finished()
    end = _allowed(grammar, vocab)
    assert set(torch.nonzero(end).flatten().tolist()) <= set(tokenizer.eog_ids)
    bad = json.dumps({"n": 1, "tag": "c"}, separators=(",", ":"))
    grammar = JsonGrammar(gtok, text)
    refused = False
    for token in gtok.view(bad):
        if not _allowed(grammar, vocab)[token]:
            refused = True
            break
        grammar.accept(token)
    assert refused


def test_a_failed_matcher_leaves_only_end_of_generation(tokenizer):
    vocab = tokenizer.vocab_size
    gtok = grammar_tokenizer(tokenizer)
    grammar = JsonGrammar(gtok, json_schema_grammar(SCHEMA))
    grammar.accept(gtok.view("]")[0])  # not a valid start: error state
    mask = _allowed(grammar, vocab)
    assert set(torch.nonzero(mask).flatten().tolist()) == set(tokenizer.eog_ids)


def test_bad_schemas_are_invalid_requests(tokenizer):
    gtok = grammar_tokenizer(tokenizer)
    with pytest.raises(InvalidRequest):
        JsonGrammar(gtok, json_schema_grammar({"type": "no-such-type"}))
    with pytest.raises(InvalidRequest):
        json_schema_grammar({"enum": ["x" * 300_000]})
    assert grammar_tokenizer(tokenizer) is gtok  # cached per model
