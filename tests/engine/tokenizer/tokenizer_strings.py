"""Test strings for tokenizer parity: a hand-written list plus seeded random mixtures."""

from __future__ import annotations

import random
import unicodedata

# Special-token spellings of the vocabularies under test (and look-alikes), written as text.
SPECIAL_SPELLINGS = [
    "<s>", "</s>", "<unk>", "<pad>", "<mask>", "<bos>", "<eos>", "<start_of_turn>",
    "<end_of_turn>", "<start_of_image>", "<unused0>", "<unused12>", "<|im_start|>",
    "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|fim_prefix|>", "<|file_sep|>",
    "<|reserved_special_token_5|>", "[multimodal]", "<table>", "</td>", "<b>", "<s", "s>",
    "<|im_start", "<|", "|>", "<0x0A>", "<0x41>",
]

HAND_WRITTEN = [
    "", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", "\n\n\n", " \n", "\n ", "\t\t\n  \n",
    "a", " a", "  a", "a ", "a  ", "   leading spaces", "trailing spaces   ",
    "Hello world", "Hello World!", "hello, world.", " Hello", "Hello\nworld", "Hello\n\nworld",
    "Hello\tworld", "Hello \t world", "Hello  world   again", "HELLO WORLD", "hElLo WoRlD",
    "It's", "it's we've they're I'm you'll he'd", "IT'S WE'VE THEY'RE I'M YOU'LL HE'D",
    "don't", "'s 't 're 've 'm 'll 'd", " 's", "rock 'n' roll", "the dog's bone",
    "What? Really! Yes. No, maybe...", "a ? b : c", "x , y . z ! w ?", "' ' '",
    "1", "12", "123", "1234", "12345", "1234567890", "3.14159", "1,000,000", "2024-01-01",
    "v1.2.3", "0x1F", "1e-10", "١٢٣٤٥", "一二三", "½ ¾ ²", "Ⅻ", "x²+y²=z²",
    "def f(x):\n    return x * 2\n", "int main() {\n\treturn 0;\n}\n",
    "for i in range(10):\n        print(i)", "if (a && b || !c) { x++; }",
    '{"key": "value", "n": [1, 2, 3]}', "<html><body><div>x</div></body></html>",
    "<table><tr><td>1</td></tr></table>", "SELECT * FROM t WHERE id = 1;",
    "https://example.com/path?q=1&r=2#frag", "user@example.com", "#!/bin/bash\necho $HOME",
    "    indented\n        more\n\tTabbed", "a\u00a0b", "a\u2028b", "a\u3000b", "a\u200bb",
    "\ufeffBOM", "\u0000\u0001\u001f\u007f", "\x0b\x0c", "a\x85b", "\ue000\uf8ff",
    "日本語のテキストです。", "中文测试，你好世界！", "한국어 텍스트입니다", "ひらがな カタカナ",
    "العربية نص تجريبي", "שלום עולם", "हिन्दी पाठ", "ภาษาไทย", "Ελληνικά", "Русский текст",
    "Tiếng Việt có dấu", "ǅungla ǈudi", "e\u0301", "cafe\u0301 nai\u0308ve",
    "Z\u0324\u0354\u0367\u0311a\u0308\u0356\u032dl\u036e\u0312g\u030c\u0317o\u0319",
    "\u0915\u094d\u0937", "🤖", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸🇯🇵", "❤️", "☺︎", "🧑🏾‍💻 coding",
    "emoji🙂inside", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𠀀𠀁", "\U0001f600\U0001f601\U0001f602",
    "\u0378\u0379", "mixed 日本 and English", "ÀÉÎÕÜ àéîõü ß ẞ", "ﬁ ﬂ", "Ω K Å",
    "<s>", "</s>", "<s> hello", "hello <s>", "hello<s>world", "<s><s>", "<s></s>",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", "<|im_end|>",
    "x<|im_end|>y", " <|im_end|> ", "<|endoftext|>", "<|begin_of_text|>Hi",
    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "<|eot_id|><|eot_id|>",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<bos><eos>",
    "<end_of_turn>", " <end_of_turn> ", "text<unk>text", "<pad><mask>", "<unused5>",
    "<|im_start|>", "<|im_start", "im_start|>", "<|fim_prefix|>a<|fim_suffix|>b",
    "<table>x</table>", "<b>bold</b>", "<0x0A>", "<0x41><0xE4>", "[multimodal]",
    "a" * 300, "ab " * 100, " " * 40, "\n" * 40, "\t" * 40, "1" * 100, "!" * 50, "🤖" * 20,
    "The quick brown fox jumps over the lazy dog. " * 8,
]

_WORDS = ["the", "The", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "it's",
          "don't", "Hello", "world", "token", "izer", "llama", "Gemma", "Qwen", "ing", "tion"]
_PUNCT = list(".,;:!?'\"()[]{}<>/\\|-_=+*&^%$#@~`")
_SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\u00a0", "\u3000", "    "]
_CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持音考片形包格形"  # noqa: E501
_OTHER_SCRIPTS = "ابتثجحخدذرسشصضطظعغفقكلمنهويאבגדהוזחטיכלמנסעפצקרשתกขคงจฉชซฌญฎฏАБВГДЕЖЗИЙКЛМНОПРСТабвгдежзийклмнопрстαβγδεζηθικλμνξοπρσςτυφχψωअआइईउऊऋएऐओऔकखगघङचछजझञ가나다라마바사아자차카타파하"  # noqa: E501
_COMBINING = ["\u0300", "\u0301", "\u0302", "\u0303", "\u0308", "\u0327", "\u0336", "\u20dd",
              "\u094d", "\u0e31", "\u05b8", "\u064e"]
_EMOJI = ["😀", "🤖", "👍", "🏽", "\u200d", "\ufe0f", "👩", "👨", "👧", "🚀", "🇯", "🇵", "❤",
          "🧑", "💻", "🌈", "🏳", "✨", "🥲", "🫠"]
_DIGITS = ["0", "1", "7", "42", "123", "2024", "99999", "3.14", "1,000", "١", "٣", "½"]
_CODE = ["def ", "return ", "    ", "\t", "{", "}", "()", "[]", "=>", "->", "==", "!=", "&&",
         "||", "/*", "*/", "//", "#include", "<div>", "</div>", "import ", "$x", "@dec"]


# Blocks complete since Unicode 14 (llama.cpp's tables are Unicode 15.1, Oniguruma in
# `tokenizers` 16.0: characters new in 16.0 are letters to one and unassigned to the other).
_BLOCKS = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0x97F),
           (0xE00, 0xE7F), (0x2000, 0x2BFF), (0x3000, 0x30FF), (0x4E00, 0x9FFF),
           (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0xFF00, 0xFFEF), (0x1D400, 0x1D7FF),
           (0x1F300, 0x1F64F), (0x20000, 0x2A6DF)]


def _random_char(rng: random.Random) -> str:
    while True:
        low, high = rng.choice(_BLOCKS)
        ch = chr(rng.randint(low, high))
        if unicodedata.category(ch) != "Cn":
            return ch


def _random_piece(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.22:
        return rng.choice(["", " "]) + rng.choice(_WORDS)
    if kind < 0.34:
        return rng.choice(_SPACES)
    if kind < 0.44:
        return "".join(rng.choice(_CJK) for _ in range(rng.randint(1, 6)))
    if kind < 0.52:
        return "".join(rng.choice(_OTHER_SCRIPTS) for _ in range(rng.randint(1, 6)))
    if kind < 0.58:
        return rng.choice(_OTHER_SCRIPTS + "aeiou") + rng.choice(_COMBINING)
    if kind < 0.67:
        return "".join(rng.choice(_EMOJI) for _ in range(rng.randint(1, 4)))
    if kind < 0.75:
        return rng.choice(_DIGITS)
    if kind < 0.83:
        return rng.choice(_CODE)
    if kind < 0.90:
        return rng.choice(_PUNCT) * rng.randint(1, 3)
    if kind < 0.97:
        return rng.choice(SPECIAL_SPELLINGS)
    return "".join(_random_char(rng) for _ in range(rng.randint(1, 4)))


def generated_strings(count: int = 420, seed: int = 20260101) -> list[str]:
    rng = random.Random(seed)
    return ["".join(_random_piece(rng) for _ in range(rng.randint(1, 24))) for _ in range(count)]


def parity_strings() -> list[str]:
    """At least 500 strings: the hand-written ones, then the seeded random ones."""
    return HAND_WRITTEN + generated_strings()


# Characters that SPM vocabularies spell in <0xXX> byte tokens (rare CJK, historic scripts,
# recent emoji), mixed with text, for the streaming detokenizer.
STREAM_STRINGS = [
    "日本語のテキスト、絵文字🤖と𠀀𠀁𠀂。", "𓀀𓀁𓀂 hieroglyphs 𒀀𒀁 cuneiform 𐀀𐀁 Linear B",
    "emoji: 🫠🫨🪿🧌 and 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 🇺🇳 UN", "𝕬𝖑𝖕𝖍𝖆 𝔅𝔢𝔱𝔞 𝒢𝒶𝓂𝓂𝒶",
    "ꙮ multiocular o, ᚠᚢᚦᚨᚱᚲ runes, ⵣ tifinagh", "中文：龘靐齉齾爩鱻麤龗灪",
    " 𠜎𠜱𠝹𠱓 ext-B ", "ᐊᓕᒍᖅ ᓄᓇᕗᑦ syllabics", "Ꭰ Ꭱ Ꭲ cherokee ᏣᎳᎩ", "ꦗꦮ javanese ꦱꦸꦏ",
    "𖹀𖹁 medefaidrin, 𞤀𞤁 adlam", "\U0001f9ec\U0001fae8\U0001fabf\U0001f6dd", "x\U000e0041y",
    "🧑🏿‍🦽‍➡️ wheelchair", "☃︎ ☃️", "\u2603\ufe0e\u2603\ufe0f", "ℵ₀ < 𝔠, ∮ E⋅da = Q",
]
