"""BPE pre-tokenizers by `tokenizer.ggml.pre`, as llama.cpp's `llm_tokenizer_bpe` defines them.

Each entry is the list of regexes llama.cpp applies one after another (every regex splits
every piece left by the previous one into its matches and the gaps between them, like
`tokenizers`' `Split(..., behavior="isolated")`), plus the per-name flags of
`llama_vocab::impl::load`: `clean_spaces`, `ignore_merges` and a default for `add_bos`.
The regexes are llama.cpp's own strings: its custom splitters (gpt2, llama3, qwen2) and its
std::regex fallback (on "collapsed" category codes) both implement these regexes' meaning,
which Oniguruma in `tokenizers` matches directly. Two translations are needed: ECMAScript `$`
(end of input) is Oniguruma's `\\z`, and literal character ranges exclude non-ASCII
whitespace (see `_literal_class`).
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
# llama.cpp runs regexes without \p{..} classes through std::wregex on text whose non-ASCII
# whitespace was replaced by \v first: such whitespace never matches a literal range there.
_WIDE_SPACE = "\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def _literal_class(ranges: str) -> str:
    return f"[{ranges}&&[^{_WIDE_SPACE}]]"


_CJK = "一-龥ࠀ-一가-퟿"
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295"
    "-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-"
    "\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-"
    "\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-"
    "\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-"
    "\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e"
    "\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-"
    "\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
    "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-"
    "\U0001e943&&[^" + _WIDE_SPACE + "]]+"
)
_DEEPSEEK_LLM = [
    r"[\r\n]",
    _DEEPSEEK_LLM_LETTERS,
    r"\s?" + _literal_class("!-/:-~！-／：-～‘-‟　-。") + "+",
    r"\s+\z",
    _literal_class(_CJK) + "+",
    r"\p{N}+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _literal_class(_CJK) + "+", r"\p{N}"]
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    _literal_class("一-龥぀-ゟ゠-ヿ") + "+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"]
_STARCODER = [r"\p{N}", GPT2]
_BLOOM = [r" ?[^(\s|.,!?…。，、।۔،)]+"]
_VIKING = [r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"]
_CASE_SPLIT = (  # tekken / gpt-4o: upper-then-lower letter runs
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+@C@"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*@C@"
    r"|@N@| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = [_CASE_SPLIT.replace("@C@", "").replace("@N@", r"\p{N}")]
_GPT4O = [_CASE_SPLIT.replace("@C@", _CONTRACTIONS + "?").replace("@N@", r"\p{N}{1,3}")]
_SEED_CODER = [
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
]


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """How llama.cpp splits text before BPE merges, for one `tokenizer.ggml.pre` name."""

    regexes: tuple[str, ...]
    clean_spaces: bool = True  # llama.cpp's clean_up_tokenization_spaces in detokenize
    ignore_merges: bool = False  # a word that is a whole token skips the merges
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token
    bos_disabled: bool = False  # chatglm/glm: no BOS whatever the defaults say
    # SentencePiece-style BPE (gemma4): spaces escaped to U+2581, merges over raw UTF-8 (no
    # GPT-2 byte mapping), `<0xXX>` byte fallback, BOS always added, and a run of newlines
    # that is a token stays whole.
    spm_style: bool = False


def _p(regexes: list[str], **flags: bool) -> PreTokenizer:
    return PreTokenizer(tuple(regexes), **flags)


_TABLE: dict[tuple[str, ...], PreTokenizer] = {
    ("default", ""): _p(_DEFAULT),
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
     "jina-v5-nano"): _p([LLAMA3], ignore_merges=True, add_bos=True),
    ("dbrx", "smaug-bpe"): _p([LLAMA3]),
    ("deepseek-llm",): _p(_DEEPSEEK_LLM, clean_spaces=False),
    ("deepseek-coder",): _p(_DEEPSEEK_CODER, clean_spaces=False),
    ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"): _p(_DEEPSEEK3, clean_spaces=False),
    ("falcon",): _p(_FALCON),
    ("mpt", "olmo", "jais", "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
     "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "exaone4", "jina-v1-en", "jina-v2-code",
     "roberta-bpe"): _p([GPT2]),
    ("trillion", "granite-docling"): _p([GPT2], clean_spaces=False),
    ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"): _p(_STARCODER),
    ("command-r", "smollm"): _p(_STARCODER, clean_spaces=False),
    ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"):
        _p([QWEN2], clean_spaces=False),
    ("megrez", "stablelm2"): _p([QWEN2]),
    ("qwen35",): _p([QWEN35], clean_spaces=False),
    ("poro-chat",): _p(_BLOOM, clean_spaces=False),
    ("bloom", "gpt3-finnish"): _p(_BLOOM),
    ("viking",): _p(_VIKING, clean_spaces=False),
    ("chatglm-bpe",): _p([LLAMA3], bos_disabled=True),
    ("glm4", "glm5"): _p([LLAMA3], bos_disabled=True, ignore_merges=True),
    ("tekken",): _p(_TEKKEN, clean_spaces=False, ignore_merges=True, add_bos=True),
    ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"): _p(_GPT4O, clean_spaces=False),
    ("seed-coder",): _p(_SEED_CODER, clean_spaces=False),
    ("gemma4", "granite-embed-multi-311m"): _p([r"[^\n]+|[\n]+"], spm_style=True),
}
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    name: pre for names, pre in _TABLE.items() for name in names
}
