"""llama.cpp's own tokenizer test vectors (models/ggml-vocab-*.gguf.inp/.out, the inputs and
expected ids of its test-tokenizer-0: add_special=false, parse_special=false)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

SEPARATOR = "\n__ggml_vocab_test__\n"
# Every vocabulary with test vectors whose tokenizer model we implement (bert-bge is WPM).
VOCABS = ["llama-spm", "llama-bpe", "qwen2", "gpt-2", "phi-3", "starcoder", "deepseek-coder",
          "deepseek-llm", "falcon", "mpt", "command-r", "refact", "qwen35", "gemma-4"]


def read_vectors(models: Path, name: str) -> list[tuple[str, list[int]]]:
    """Split as test-tokenizer-0.cpp does: inputs on the separator, one output per line."""
    raw = (models / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    outs = (models / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    inputs: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    assert len(outs) >= len(inputs), f"{name}: fewer outputs than inputs"
    return [(text, [int(t) for t in out.split()]) for text, out in zip(inputs, outs, strict=False)]


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_vectors(name: str, llama_models: Path, our_vocab: Callable) -> None:
    vectors = read_vectors(llama_models, name)
    assert len(vectors) >= 40
    _, _, tok = our_vocab(name)
    wrong = [(text, want, got) for text, want in vectors
             if (got := tok.encode(text, add_special=False)) != want]
    assert not wrong, f"{name}: {len(wrong)}/{len(vectors)} differ, first: {wrong[0]!r}"
