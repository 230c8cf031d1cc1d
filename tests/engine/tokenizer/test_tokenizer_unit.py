"""Tokenizer construction: metadata as the loader gives it, refusals with TokenizerError,
and the decode rules for BOS/EOS on a small hand-made vocabulary."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from engine.errors import TokenizerError
from engine.gguf import ModelFile
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


def test_model_file_metadata_gives_the_same_tokenizer(vocab_case: Callable) -> None:
    """The contract with engine.gguf: ModelFile.metadata (numpy arrays, MappingProxyType)
    builds the tokenizer that the GGUFReader-based test helper builds."""
    case = vocab_case("llama-spm")
    tok = Tokenizer.from_metadata(ModelFile.open(case.path).metadata)
    for text in ["Hello world", "<s>user\nhi</s>", "日本語 🤖", "  x\n\n"]:
        for parse_special in (False, True):
            want = case.ref.tokenize(text, True, parse_special)
            assert tok.encode(text, parse_special=parse_special) == want
    assert (tok.eog_ids, tok.bos_id, tok.add_bos) == (case.ours.eog_ids, case.ours.bos_id,
                                                      case.ours.add_bos)


def _spm_metadata(**extra: Any) -> dict[str, Any]:
    """A small SPM vocabulary: <unk>, <s>, </s>, 256 byte tokens, a few pieces (259-265),
    user-defined "xyz" and "wx" (they overlap in "wxyz"), "<|end|>" (user-defined in the
    file, an EOG marker by its text) and control tokens "<|ctl|>" and "<|endoftext|>"."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["\u2581", "a", "b", "\u2581a", "ab", "\u2581ab", "end", "xyz", "wx", "<|end|>",
               "<|ctl|>", "<|endoftext|>"]
    types = [2, 3, 3] + [6] * 256 + [1] * 7 + [4, 4, 4, 3, 3]
    scores = [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0] + [0.0] * 5
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": np.asarray(scores, np.float32),
            "tokenizer.ggml.token_type": np.asarray(types, np.int32)}
    meta.update(extra)
    return meta


@pytest.mark.parametrize("change, message", [
    ({"tokenizer.ggml.model": "bert"}, "not supported"),
    ({"tokenizer.ggml.model": None}, "not supported"),
    ({"tokenizer.ggml.tokens": []}, "missing or empty"),
    ({"tokenizer.ggml.tokens": ["a", "a", "b"]}, "duplicate"),
    ({"tokenizer.ggml.tokens": [1, 2, 3]}, "strings"),
    ({"tokenizer.ggml.bos_token_id": "one"}, "integer"),
    ({"tokenizer.ggml.scores": np.zeros(3, np.float32)}, "entries for"),
    ({"tokenizer.ggml.token_type": ["x"] * 300}, "numeric"),
    ({"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eos_token_id": 10**6,
      "tokenizer.ggml.tokens": ["<unk>", "<s>"], "tokenizer.ggml.scores": None,
      "tokenizer.ggml.token_type": None}, "no EOS"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"}, "merges"),
    ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such-pre",
      "tokenizer.ggml.merges": ["a b"]}, "pre"),
])
def test_refusals(change: dict[str, Any], message: str) -> None:
    meta = {k: v for k, v in {**_spm_metadata(), **change}.items() if v is not None}
    if change.get("tokenizer.ggml.model", "llama") is None:
        meta.pop("tokenizer.ggml.model", None)
    with pytest.raises(TokenizerError, match=message):
        Tokenizer.from_metadata(meta)


def _write_gguf(path: Path, meta: dict[str, Any]) -> Path:
    """`meta` as a vocab-only llama GGUF that llama.cpp loads."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_scores(meta["tokenizer.ggml.scores"].tolist())
    writer.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
    if "tokenizer.ggml.eos_token_id" in meta:
        writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.add_eos_token" in meta:
        writer.add_add_eos_token(meta["tokenizer.ggml.add_eos_token"])
    if "general.name" in meta:
        writer.add_name(meta["general.name"])
    # llama.cpp reads the hyperparameters even for vocab_only.
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("extra", [
    {},
    # add_eos with an EOS that decode shows ("end", a normal token): decode(skip_special)
    # drops it only as the last token, so the streaming detokenizer must hold it back.
    {"tokenizer.ggml.add_eos_token": True, "tokenizer.ggml.eos_token_id": 265},
    # llama.cpp gives phi-3 models rstrip on special tokens (by general.name).
    {"general.name": "Phi3 tiny"},
])
def test_small_spm_vocab_matches_llama_cpp(extra: dict[str, Any], tmp_path: Path) -> None:
    from tokenizer_reference import LlamaVocabRef

    meta = _spm_metadata(**extra)
    ref = LlamaVocabRef(_write_gguf(tmp_path / "small.gguf", meta))
    tok = Tokenizer.from_metadata(meta)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (
        ref.bos(), ref.eos(), ref.add_bos(), ref.add_eos())
    assert tok.eog_ids == {i for i in range(ref.n_tokens) if ref.is_eog(i)}
    texts = ["", "ab", "a b", " ab ab", "abab", "é", "end", "<s>ab</s>", "b a", "wxyz", "awxyzb",
             "xyzwx", "wx yz", "a <s> b", "a<|end|> b", " <|ctl|>  a\n", "<|ctl|><|end|>\tab",
             "a </s>\n\nb", "<unk>xyz", "x <|endoftext|> y"]
    for text in texts:
        for add_special, parse_special in itertools.product((False, True), repeat=2):
            assert tok.encode(text, add_special, parse_special) == ref.tokenize(
                text, add_special, parse_special), (text, add_special, parse_special)
    sequences = [[1, 264], [264, 265, 264], [1, 264, 265], [265], [1, 265, 264], [264, 265, 265],
                 [1], [262, 0, 261], [3 + 0xC3, 3 + 0xA9, 264], [3 + 0xC3], [266, 268, 267, 269]]
    for ids in sequences:
        for skip in (False, True):
            want = ref.detokenize(ids, skip, not skip)
            assert tok.decode_bytes(ids, skip) == want, (ids, skip)
            detok = IncrementalDetokenizer(tok, skip_special=skip)
            streamed = "".join(detok.push(i) for i in ids) + detok.flush()
            assert streamed == want.decode("utf-8", "replace"), (ids, skip)


def test_unpaired_surrogates_are_replaced(vocab_case: Callable) -> None:
    """JSON can carry lone surrogates, which have no UTF-8 form; they tokenize as U+FFFD."""
    tok = vocab_case("llama-bpe").ours
    assert tok.encode("a\ud800b\udfff") == tok.encode("a\ufffdb\ufffd")
