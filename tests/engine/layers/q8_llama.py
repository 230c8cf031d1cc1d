"""Test helper: a tiny Llama GGUF whose linears are the q8 layout's block types (Q4_K and
Q6_K: qint gives a row the same bits at any row count), and random token ids."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

from engine.synthetic import SyntheticSpec, write_synthetic_gguf

TYPES = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_K, "attn_v.weight": T.Q6_K,
         "attn_output.weight": T.Q4_K, "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K,
         "ffn_down.weight": T.Q6_K}


def write_q8_llama(path: Path, vocab_dir: Path, num_layers: int, seed: int) -> Path:
    """256 wide, 4 heads on 2 KV heads of 64, FFN 512, the rest F32; -> path."""
    spec = SyntheticSpec("llama", num_layers=num_layers, hidden_size=256, num_heads=4,
                         num_kv_heads=2, head_dim=64, ffn_size=512, types=TYPES,
                         default_type=T.F32)
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=seed)
    return path


def random_ids() -> Callable[[int], list[int]]:
    """ids(n): n token ids from a freshly seeded generator (each run its own)."""
    rng = np.random.default_rng(int(np.random.SeedSequence().entropy % 2**63))
    return lambda n: rng.integers(3, 1000, n).tolist()
