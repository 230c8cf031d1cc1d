"""llama.cpp's tokenizer through llama_cpp's C API (the reference the tests compare with)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import llama_cpp


class LlamaVocabRef:
    """One GGUF vocabulary loaded by llama.cpp (vocab_only)."""

    def __init__(self, path: Path) -> None:
        # llama.cpp's log lines (double-BOS warnings...) go through this logger.
        logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_tokens = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self._buf = ctypes.create_string_buffer(256)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        size = len(data) + 8
        while True:
            out = (llama_cpp.llama_token * size)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, size, add_special,
                                         parse_special)
            if n >= 0:
                return list(out[:n])
            size = -n

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (llama_cpp.llama_token * max(1, len(ids)))(*ids)
        size = 64 + 8 * len(ids)
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self.vocab, arr, len(ids), buf, size, remove_special,
                                           unparse_special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def piece(self, token_id: int, special: bool) -> bytes:
        n = llama_cpp.llama_token_to_piece(self.vocab, token_id, self._buf, len(self._buf), 0,
                                           special)
        if n < 0:
            self._buf = ctypes.create_string_buffer(-n)
            return self.piece(token_id, special)
        return self._buf.raw[:n]

    def is_eog(self, token_id: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token_id))

    def add_bos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))

    def add_eos(self) -> bool:
        return bool(llama_cpp.llama_vocab_get_add_eos(self.vocab))

    def bos(self) -> int:
        return int(llama_cpp.llama_vocab_bos(self.vocab))

    def eos(self) -> int:
        return int(llama_cpp.llama_vocab_eos(self.vocab))
