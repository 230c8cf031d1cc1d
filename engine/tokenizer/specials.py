"""Token attributes and end-of-generation ids, decided the way llama.cpp's vocab loader does.

llama.cpp starts from `tokenizer.ggml.token_type` and then edits attributes by token text
(`llama_vocab::impl::load`): tokens that look like end-of-turn, FIM or EOG markers become
control tokens, gpt-oss's channel markers become user-defined, and per-model rules add
lstrip/rstrip. These edits decide which tokens `encode` matches in plain text and which
`decode` hides, so they are reproduced here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.errors import TokenizerError


class Attr:
    """llama.cpp's `llama_token_attr` bits (plain ints: enum flags are slow over 262K tokens)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# GGUF token_type (llama_token_type) -> attribute; anything else is UNDEFINED.
_TYPE_TO_ATTR = {0: Attr.UNDEFINED, 1: Attr.NORMAL, 2: Attr.UNKNOWN, 3: Attr.CONTROL,
                 4: Attr.USER_DEFINED, 5: Attr.UNUSED, 6: Attr.BYTE}
SPECIAL_ATTRS = Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN  # matched by the partition
HIDDEN_ATTRS = Attr.CONTROL | Attr.UNKNOWN  # dropped by decode(skip_special=True)

_FIM_TEXTS = {
    "fim_pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "fim_suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "fim_mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# The deprecated keys come first: llama.cpp reads them last, so they win.
_FIM_KEYS = {"fim_pre": ("prefix_token_id", "fim_pre_token_id"),
             "fim_suf": ("suffix_token_id", "fim_suf_token_id"),
             "fim_mid": ("middle_token_id", "fim_mid_token_id"),
             "fim_pad": ("fim_pad_token_id",), "fim_rep": ("fim_rep_token_id",),
             "fim_sep": ("fim_sep_token_id",)}
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
})
_GPT_OSS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def token_attrs(token_types: Sequence[int] | None, num_tokens: int) -> list[int]:
    if token_types is None:
        return [Attr.NORMAL] * num_tokens
    get = _TYPE_TO_ATTR.get
    return [get(t, Attr.UNDEFINED) for t in token_types[:num_tokens]]


def token_id(metadata: Mapping[str, Any], key: str, num_tokens: int) -> int | None:
    """A `tokenizer.ggml.<key>` id, or None when absent or out of range (llama.cpp then
    keeps its default, which the caller supplies)."""
    value = metadata.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    try:
        tid = int(value)
    except (TypeError, ValueError) as exc:
        raise TokenizerError(f"tokenizer.ggml.{key} is not an integer: {value!r}") from exc
    return tid if 0 <= tid < num_tokens else None


def fim_token_ids(metadata: Mapping[str, Any], ids: Mapping[str, int],
                  num_tokens: int) -> dict[str, tuple[int, bool]]:
    """The fill-in-the-middle tokens a vocabulary has: kind ("fim_pre", "fim_suf", "fim_mid",
    "fim_pad", "fim_rep", "fim_sep") -> (token id, whether found by its text rather than a
    GGUF key), as llama.cpp finds them."""
    out = {}
    for kind, candidates in _FIM_TEXTS.items():
        fim_id = next((i for k in _FIM_KEYS[kind]
                       if (i := token_id(metadata, k, num_tokens)) is not None), None)
        by_text = fim_id is None
        if fim_id is None:
            # llama.cpp takes the first candidate in its hash map's order; vocabularies
            # have one of them, and taking the first in list order is the same then.
            fim_id = next((ids[t] for t in candidates if t in ids), None)
        if fim_id is not None:
            out[kind] = (fim_id, by_text)
    return out


def apply_text_rules(
    metadata: Mapping[str, Any], texts: list[str], attrs: list[int],
    eos_id: int | None, ids: dict[str, int],
) -> frozenset[int]:
    """Edit `attrs` in place as llama.cpp does after reading the token types; return the
    end-of-generation ids. `ids` maps each token text to its id."""
    n = len(texts)
    eog: set[int] = set()

    def mark_control(tid: int) -> None:
        attrs[tid] |= Attr.CONTROL

    for kind, (fim_id, by_text) in fim_token_ids(metadata, ids, n).items():
        if by_text:
            mark_control(fim_id)
        if kind in ("fim_pad", "fim_rep", "fim_sep"):
            eog.add(fim_id)
    for text in _EOG_TEXTS:
        if (tid := ids.get(text)) is not None:
            eog.add(tid)
            mark_control(tid)
    for text in _GPT_OSS_USER_DEFINED:
        if (tid := ids.get(text)) is not None:
            attrs[tid] = Attr.USER_DEFINED
    for key in ("eot_token_id", "eom_token_id"):
        if (tid := token_id(metadata, key, n)) is not None:
            eog.add(tid)
    if eos_id is not None:
        eog.add(eos_id)
    _drop_false_eogs(texts, attrs, eog)
    return frozenset(eog)


def _drop_false_eogs(texts: list[str], attrs: list[int], eog: set[int]) -> None:
    """o200k_harmony / solar-open: `<|end|>` is not EOG when `<|return|>` and `<|call|>`
    (or `<|calls|>` and `<|flush|>`) are; gemma4 / plamo: `</s>` is a normal token."""
    by_text = {texts[i]: i for i in eog}
    has_call = "<|call|>" in by_text or "<|calls|>" in by_text
    if "<|end|>" in by_text and has_call and ("<|return|>" in by_text or "<|flush|>" in by_text):
        end_id = by_text["<|end|>"]
        eog.discard(end_id)
        attrs[end_id] = Attr.USER_DEFINED
    if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
        s_id = by_text["</s>"]
        eog.discard(s_id)
        attrs[s_id] = Attr.NORMAL


def apply_strip_rules(
    metadata: Mapping[str, Any], texts: list[str], attrs: list[int], ids: dict[str, int],
) -> None:
    """Per-model lstrip/rstrip, keyed on the model name as llama.cpp does (the GGUF has no
    per-token attributes)."""
    name = str(metadata.get("general.name", "")).lower()
    pre = str(metadata.get("tokenizer.ggml.pre", ""))
    arch = str(metadata.get("general.architecture", ""))
    if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
        s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
    ):
        if "<mask>" in ids:
            attrs[ids["<mask>"]] |= Attr.LSTRIP
    elif "phi-3" in name or "phi3" in name:
        for tid, attr in enumerate(attrs):
            if attr & SPECIAL_ATTRS:
                attrs[tid] |= Attr.RSTRIP
        if "</s>" in ids:
            attrs[ids["</s>"]] |= Attr.RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in ids:
                attrs[ids[text]] &= ~Attr.RSTRIP
    elif "modern-bert" in name and "[MASK]" in ids:
        attrs[ids["[MASK]"]] |= Attr.LSTRIP
