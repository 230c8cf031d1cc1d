"""GGUF vocabularies as tokenizers with llama.cpp's behaviour, and streaming detokenization."""

from __future__ import annotations

from engine.tokenizer.detok import IncrementalDetokenizer
from engine.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
