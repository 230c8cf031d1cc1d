"""GGUF tokenizer metadata -> `Vocab` (what llama.cpp's loader decides) -> `tokenizers.Tokenizer`.

Three vocabulary kinds are supported, as llama.cpp names them by `tokenizer.ggml.model`:

- `llama` (SPM): llama.cpp merges, at each step, the adjacent pair whose concatenation is
  the highest-scoring vocabulary token (leftmost on ties), and spells any character left
  outside the vocabulary as `<0xXX>` byte tokens. That is a BPE whose merges are every
  split (a, b) of every token with both halves in the vocabulary, ranked by the token's
  score: `tokenizers.models.BPE` with `byte_fallback`, spaces escaped to U+2581 first.
  Known difference: llama.cpp breaks a tie between two different tokens of equal score by
  position (leftmost first), a ranked BPE by token id. Real vocabularies give normal tokens
  distinct scores; only control/user-defined ones share one (-1000 in gemma3).
- `gpt2` (byte-level BPE): the file's merges, ranked by position, after the regex splits of
  the file's `tokenizer.ggml.pre` (see `pretok.py`) and GPT-2's byte-to-unicode mapping.
- `gemma4` (BPE over SentencePiece-style pieces): the file's merges on raw UTF-8 with spaces
  escaped, `<0xXX>` byte fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from engine.errors import TokenizerError
from engine.tokenizer.pretok import PRE_TOKENIZERS, PreTokenizer
from engine.tokenizer.specials import (
    Attr,
    apply_strip_rules,
    apply_text_rules,
    fim_token_ids,
    token_attrs,
    token_id,
)

logger = logging.getLogger(__name__)

SPACE_ESCAPE = "\u2581"  # SentencePiece's visible space


@dataclass(slots=True)
class Vocab:
    """A GGUF vocabulary as llama.cpp's loader leaves it."""

    kind: str  # "spm" | "bpe"
    texts: list[str]  # token id -> GGUF token text
    ids: dict[str, int]  # GGUF token text -> token id
    scores: np.ndarray  # (num_tokens,) float32, SPM merge priority
    attrs: list[int]  # token id -> attributes after llama.cpp's text rules
    merges: list[tuple[str, str]]  # BPE only, in rank order
    pre: PreTokenizer | None  # BPE only
    bos_id: int | None
    eos_id: int | None
    eog_ids: frozenset[int]
    fim_ids: dict[str, int]  # fill-in-the-middle tokens by kind ("fim_pre", "fim_suf" ...)
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    clean_spaces: bool


def parse_vocab(metadata: Mapping[str, Any]) -> Vocab:
    model = metadata.get("tokenizer.ggml.model")
    if model not in ("llama", "gpt2", "gemma4"):
        raise TokenizerError(
            f"tokenizer.ggml.model {model!r} is not supported ('llama', 'gpt2', 'gemma4')"
        )
    texts = _token_texts(metadata)
    num_tokens = len(texts)
    ids = {text: i for i, text in enumerate(texts)}
    if len(ids) != num_tokens:
        raise TokenizerError("tokenizer.ggml.tokens has duplicate tokens")
    scores = _numeric_array(metadata, "tokenizer.ggml.scores", num_tokens, np.float32)
    types = _numeric_array(metadata, "tokenizer.ggml.token_type", num_tokens, np.int64)
    attrs = token_attrs(None if types is None else types.tolist(), num_tokens)

    pre: PreTokenizer | None = None
    merges: list[tuple[str, str]] = []
    if model == "llama":
        default_bos, default_eos = 1, 2
        add_space_prefix, clean_spaces, add_bos = True, False, True
    else:
        pre_name = "gemma4" if model == "gemma4" else str(metadata.get("tokenizer.ggml.pre") or "")
        if pre_name not in PRE_TOKENIZERS:
            raise TokenizerError(f"tokenizer.ggml.pre {pre_name!r} is not supported")
        pre = PRE_TOKENIZERS[pre_name]
        merges = _bpe_merges(metadata)
        default_bos, default_eos = (None if pre.bos_disabled else 11), 11
        if model == "gemma4":
            default_bos = default_eos = None
        add_space_prefix, clean_spaces, add_bos = False, pre.clean_spaces, pre.add_bos
    add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
    if pre is not None and pre.spm_style:
        add_bos = True  # llama.cpp overrides the file for gemma4
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))

    def special(key: str, default: int | None) -> int | None:
        found = token_id(metadata, key, num_tokens)
        if found is not None:
            return found
        return default if default is not None and default < num_tokens else None

    bos_id, eos_id = special("bos_token_id", default_bos), special("eos_token_id", default_eos)
    if add_bos and bos_id is None:
        raise TokenizerError("tokenizer.ggml.add_bos_token is set but there is no BOS token")
    if add_eos and eos_id is None:
        raise TokenizerError("tokenizer.ggml.add_eos_token is set but there is no EOS token")
    eog_ids = apply_text_rules(metadata, texts, attrs, eos_id, ids)
    apply_strip_rules(metadata, texts, attrs, ids)
    return Vocab(
        kind="spm" if model == "llama" else "bpe", texts=texts, ids=ids,
        scores=np.zeros(num_tokens, np.float32) if scores is None else scores,
        attrs=attrs, merges=merges, pre=pre, bos_id=bos_id, eos_id=eos_id, eog_ids=eog_ids,
        fim_ids={k: i for k, (i, _) in fim_token_ids(metadata, ids, num_tokens).items()},
        add_bos=add_bos, add_eos=add_eos, add_space_prefix=add_space_prefix,
        clean_spaces=clean_spaces,
    )


def _token_texts(metadata: Mapping[str, Any]) -> list[str]:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None or len(tokens) == 0:
        raise TokenizerError("tokenizer.ggml.tokens is missing or empty")
    if not all(isinstance(t, str) for t in tokens):
        raise TokenizerError("tokenizer.ggml.tokens is not an array of strings")
    # llama.cpp renames empty tokens so that every text maps to one id.
    return [str(t) if len(t) else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def _numeric_array(
    metadata: Mapping[str, Any], key: str, num_tokens: int, dtype: type,
) -> np.ndarray | None:
    value = metadata.get(key)
    if value is None:
        return None
    try:
        arr = np.asarray(value, dtype=dtype).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise TokenizerError(f"{key} is not a numeric array") from exc
    if arr.shape[0] < num_tokens:
        raise TokenizerError(f"{key} has {arr.shape[0]} entries for {num_tokens} tokens")
    return arr[:num_tokens]


def _bpe_merges(metadata: Mapping[str, Any]) -> list[tuple[str, str]]:
    raw = metadata.get("tokenizer.ggml.merges")
    if raw is None:
        raise TokenizerError("tokenizer.ggml.merges is missing (needed by a 'gpt2' vocabulary)")
    raw = [str(line) for line in raw]
    if len(set(raw)) != len(raw):  # llama.cpp keeps the first rank of a repeated merge
        raw = list(dict.fromkeys(raw))
    # llama.cpp splits at the first space after the first character. This is the hot path
    # (500K merges); lines that start with a space are rare.
    parts = [line.partition(" ") if line[:1] != " " else _split_late(line) for line in raw]
    return [(a, b) for a, space, b in parts if space]


def _split_late(line: str) -> tuple[str, str, str]:
    pos = line.find(" ", 1)
    return (line, "", "") if pos < 0 else (line[:pos], " ", line[pos + 1:])


def _bpe_model(vocab: Vocab, index: dict[str, int], **options: Any) -> models.BPE:
    """`tokenizers` refuses merges that name tokens outside the vocabulary (llama.cpp would
    merge them and then spell the result in bytes); such merges are dropped."""
    try:
        return models.BPE(index, vocab.merges, **options)
    except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception here
        merges = [(a, b) for a, b in vocab.merges if a in index and b in index and a + b in index]
        logger.warning("%d BPE merges name tokens outside the vocabulary; dropped",
                       len(vocab.merges) - len(merges))
        return models.BPE(index, merges, **options)


def spm_merges(
    texts: list[str], scores: np.ndarray, index: Mapping[str, int],
) -> list[tuple[str, str]]:
    """Every (left, right) split of every token with both halves in the vocabulary, ordered
    by the token's score, highest first (ties: lower token id, then shorter left half)."""
    merged_ids: list[int] = []
    cut_at: list[int] = []
    for tid, text in enumerate(texts):
        for k in range(1, len(text)):
            if text[:k] in index and text[k:] in index:
                merged_ids.append(tid)
                cut_at.append(k)
    mids = np.asarray(merged_ids, dtype=np.int64)
    cuts = np.asarray(cut_at, dtype=np.int64)
    order = np.lexsort((cuts, mids, -scores.astype(np.float64)[mids]))
    return [(texts[m][:k], texts[m][k:]) for m, k in zip(mids[order].tolist(),
                                                        cuts[order].tolist(), strict=True)]


def build_hf_tokenizer(vocab: Vocab) -> Tokenizer:
    """The merge stage of `vocab` as a `tokenizers.Tokenizer`. Special tokens are not
    registered: `Tokenizer.encode` splits them out first, the way llama.cpp does, and hands
    only the text between them to this object."""
    index = vocab.ids
    if vocab.kind == "spm":
        model = models.BPE(index, spm_merges(vocab.texts, vocab.scores, index), byte_fallback=True)
        hf = Tokenizer(model)
        hf.normalizer = normalizers.Replace(" ", SPACE_ESCAPE)
        hf.decoder = decoders.Sequence(
            [decoders.Replace(SPACE_ESCAPE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        return hf
    pre = vocab.pre
    assert pre is not None
    model = _bpe_model(vocab, index, ignore_merges=pre.ignore_merges,
                       byte_fallback=pre.spm_style)
    hf = Tokenizer(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    if pre.spm_style:
        hf.normalizer = normalizers.Replace(" ", SPACE_ESCAPE)
        hf.pre_tokenizer = pre_tokenizers.Sequence(splits)
        hf.decoder = decoders.Sequence(
            [decoders.Replace(SPACE_ESCAPE, " "), decoders.ByteFallback(), decoders.Fuse()]
        )
        return hf
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    hf.decoder = decoders.ByteLevel()
    return hf


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte -> printable character table, inverted."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_CHARS = frozenset(_BYTE_DECODER)
_BYTE_TRANSLATION = {ord(c): b for c, b in _BYTE_DECODER.items()}


def _bpe_text_bytes(text: str) -> bytes:
    if _BYTE_CHARS.issuperset(text):
        return text.translate(_BYTE_TRANSLATION).encode("latin-1")
    out = bytearray()
    for ch in text:  # llama.cpp's llama_decode_text, including its odd marker
        if ch in _BYTE_DECODER:
            out.append(_BYTE_DECODER[ch])
        else:
            out += f"[UNK_BYTE_0x{ch.encode().hex()}{text}]".encode()
    return bytes(out)


def _byte_token_value(text: str) -> int:
    try:  # llama.cpp: strtol(text.substr(3, 2), 16)
        return int(text[3:5], 16) & 0xFF
    except ValueError:
        return 0


def token_pieces(vocab: Vocab) -> list[bytes]:
    """Token id -> the bytes llama.cpp's token_to_piece gives with special=true: special and
    user-defined tokens verbatim, normal tokens unescaped, byte tokens as their byte,
    anything else (unused, undefined) empty."""
    pieces: list[bytes] = []
    verbatim = Attr.CONTROL | Attr.UNKNOWN | Attr.USER_DEFINED
    unescape = vocab.kind == "spm" or (vocab.pre is not None and vocab.pre.spm_style)
    for text, attr in zip(vocab.texts, vocab.attrs, strict=True):
        if attr & verbatim:
            pieces.append(text.encode())
        elif attr & Attr.NORMAL:
            pieces.append(text.replace(SPACE_ESCAPE, " ").encode() if unescape
                          else _bpe_text_bytes(text))
        elif attr & Attr.BYTE:
            pieces.append(bytes([_byte_token_value(text)]))
        else:
            pieces.append(b"")
    return pieces
