"""Synthetic GGUF recipes (engine/synthetic.py): tensor types by whole name components, and
the Q4_K_M recipe against llama.cpp's per-layer rule and a real Q4_K_M file."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as T

from engine.gguf import ModelFile, scan_file
from engine.gguf.reader import MappedReader
from engine.synthetic import (
    _tensor_type,
    ensure_synthetic,
    synthetic_spec,
    tensor_shapes,
    write_synthetic_gguf,
)

# The layers whose attn_v and ffn_down llama.cpp's Q4_K_M keeps in Q6_K, written out by
# hand from its use_more_bits(i, n) (src/llama-quant.cpp): i < n/8, i >= 7n/8, or
# (i - n/8) % 3 == 2, in C integer division.
# n = 32: n/8 = 4, 7n/8 = 28.
MORE_BITS_32 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}
# n = 36: n/8 = 4, 7n/8 = 31 (252/8).
MORE_BITS_36 = {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 31, 32, 33, 34, 35}
# n = 18: n/8 = 2, 7n/8 = 15 (126/8).
MORE_BITS_18 = {0, 1, 4, 7, 10, 13, 15, 16, 17}

# (elements per block, bytes per block), by hand from the GGML block layouts
BLOCK = {T.F32: (1, 4), T.Q4_K: (256, 144), T.Q6_K: (256, 210), T.Q5_0: (32, 22),
         T.Q8_0: (32, 34)}


def nbytes(qtype: int, rows: int, cols: int) -> int:
    block, size = BLOCK[qtype]
    assert cols % block == 0
    return rows * cols // block * size


def file_types(path: Path) -> dict[str, int]:
    return {t.name: int(t.tensor_type) for t in MappedReader(path).tensors}


def test_q4_k_m_recipe_types():
    """Whole name components: "output.weight" is the head, not attn_output; norms in F32;
    an untied token_embd keeps the default Q4_K."""
    spec = synthetic_spec("llama-3.1-8b:Q4_K_M")
    mat, vec = (4096, 4096), (4096,)
    want = {"output.weight": T.Q6_K, "blk.3.attn_output.weight": T.Q4_K,
            "blk.3.attn_v.weight": T.Q6_K, "blk.3.ffn_down.weight": T.Q6_K,
            "blk.4.attn_v.weight": T.Q4_K, "blk.4.ffn_down.weight": T.Q4_K,
            "blk.3.attn_q.weight": T.Q4_K, "blk.3.ffn_gate.weight": T.Q4_K,
            "token_embd.weight": T.Q4_K}
    for name, qtype in want.items():
        assert _tensor_type(spec, name, mat) == qtype, name
    assert _tensor_type(spec, "blk.3.attn_norm.weight", vec) == T.F32


def _layer_types(name_quant: str, vocab: int) -> dict[str, int]:
    spec = synthetic_spec(name_quant)
    return {n: _tensor_type(spec, n, s) for n, s in tensor_shapes(spec, vocab).items()}


def test_q4_k_m_llama_8b_layers():
    """Llama 3.1 8B (32 layers): attn_v and ffn_down in Q6_K on exactly llama.cpp's layers,
    Q4_K on the others; every other linear Q4_K; the untied head Q6_K."""
    types = _layer_types("llama-3.1-8b:Q4_K_M", 128256)
    for i in range(32):
        more = T.Q6_K if i in MORE_BITS_32 else T.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == more, i
        assert types[f"blk.{i}.ffn_down.weight"] == more, i
        for part in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{part}.weight"] == T.Q4_K, (i, part)
        assert types[f"blk.{i}.attn_norm.weight"] == T.F32
    assert types["output.weight"] == T.Q6_K
    assert types["token_embd.weight"] == T.Q4_K
    assert types["rope_freqs.weight"] == T.F32
    q6 = sum(t == T.Q6_K for n, t in types.items() if n.startswith("blk."))
    assert q6 == 2 * 16


def test_q4_k_m_qwen3_8b_layers():
    types = _layer_types("qwen3-8b:Q4_K_M", 151936)
    for i in range(36):
        more = T.Q6_K if i in MORE_BITS_36 else T.Q4_K
        assert types[f"blk.{i}.attn_v.weight"] == more, i
        assert types[f"blk.{i}.ffn_down.weight"] == more, i
    assert types["output.weight"] == T.Q6_K
    assert types["token_embd.weight"] == T.Q4_K


def test_q4_k_m_gemma3_270m_matches_the_real_file(default_model_path: Path):
    """The default model is Gemma 3 270M in Q4_K_M, quantized by llama.cpp: the synthetic
    spec has its tensor names, shapes and types, tensor by tensor. Its 640 columns are not a
    multiple of 256, so those tensors fall back to 32-blocks (Q4_K -> Q5_0, Q6_K -> Q8_0),
    and the tied token_embd is quantized as the head would be (Q6_K -> Q8_0)."""
    spec = synthetic_spec("gemma3-270m:Q4_K_M")
    real = {t.name: (int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)))
            for t in MappedReader(default_model_path).tensors}
    vocab = real["token_embd.weight"][1][0]
    shapes = tensor_shapes(spec, vocab)
    assert set(shapes) == set(real)
    for name, (qtype, shape) in real.items():
        assert shapes[name] == shape, name
        assert _tensor_type(spec, name, shape) == qtype, name
    v8 = {i for i in range(18) if real[f"blk.{i}.attn_v.weight"][0] == T.Q8_0}
    assert v8 == MORE_BITS_18  # the reference agrees with the hand-written rule too
    with ModelFile.open(default_model_path) as mf:  # the file type llama.cpp wrote: 15
        assert int(mf.metadata["general.file_type"]) == spec.file_type == 15


def test_q4_k_m_small_preset_file(tmp_path: Path, vocab_dir: Path):
    """The written gemma3-270m file: every tensor's type as the spec says, its data bytes
    as counted by hand, and the file no larger than that plus the header."""
    vocab_path = vocab_dir / "ggml-vocab-llama-bpe.gguf"
    vocab = 128256
    path = ensure_synthetic("gemma3-270m:Q4_K_M", vocab_path, tmp_path)
    spec = synthetic_spec("gemma3-270m:Q4_K_M")
    shapes = tensor_shapes(spec, vocab)
    assert file_types(path) == {n: _tensor_type(spec, n, s) for n, s in shapes.items()}

    h, q, kv, ffn = 640, 1024, 256, 2048
    want = nbytes(T.Q8_0, vocab, h) + nbytes(T.F32, 1, h)  # token_embd, output_norm
    for i in range(18):
        more = i in MORE_BITS_18
        want += (nbytes(T.Q5_0, q, h) + nbytes(T.Q5_0, kv, h)
                 + nbytes(T.Q8_0 if more else T.Q5_0, kv, h)
                 + nbytes(T.Q4_K, h, q)
                 + 2 * nbytes(T.Q5_0, ffn, h)
                 + nbytes(T.Q6_K if more else T.Q4_K, h, ffn)
                 + nbytes(T.F32, 1, 4 * h + 2 * 256))
    scan = scan_file(path)
    assert sum(t.n_bytes for t in scan.tensors) == want
    with ModelFile.open(path) as mf:  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
        assert int(mf.metadata["general.file_type"]) == 15
    size = path.stat().st_size
    assert want < size < want + scan.data_offset + 32 * len(scan.tensors)


@pytest.mark.slow  # writes the file three times
def test_stale_cached_file_is_rewritten(tmp_path: Path, vocab_dir: Path):
    """A cached file whose types are not the recipe's (an older recipe) is written again;
    one that matches is reused as it is."""
    vocab_path = vocab_dir / "ggml-vocab-llama-bpe.gguf"
    path = ensure_synthetic("gemma3-270m:Q4_K_M", vocab_path, tmp_path)
    want = file_types(path)
    stamp = path.stat().st_mtime_ns
    assert ensure_synthetic("gemma3-270m:Q4_K_M", vocab_path, tmp_path) == path
    assert path.stat().st_mtime_ns == stamp
    write_synthetic_gguf(path, synthetic_spec("gemma3-270m:Q8_0"), vocab_path)
    assert file_types(path) != want
    assert ensure_synthetic("gemma3-270m:Q4_K_M", vocab_path, tmp_path) == path
    assert file_types(path) == want


def test_concurrent_writers_each_write_their_own_partial(tmp_path: Path, monkeypatch):
    """Two processes filling the same cache at once (a bench beside a test run) each write
    a partial file of their own and replace the target with it whole: neither finds its
    partial taken by the other, and no partial is left behind. With one shared partial
    name the second writer's replace found nothing (FileNotFoundError)."""
    import threading

    import engine.synthetic as synthetic

    both_writing = threading.Barrier(2, timeout=10)
    written: list[Path] = []

    def slow_write(path, spec, vocab_path, seed=0):
        written.append(Path(path))
        Path(path).write_bytes(b"half")
        both_writing.wait()  # the two writers are inside their writes together
        Path(path).write_bytes(b"whole")

    monkeypatch.setattr(synthetic, "write_synthetic_gguf", slow_write)
    monkeypatch.setattr(synthetic, "_written_as", lambda path, spec: path.exists())
    errors: list[BaseException] = []

    def fill() -> None:
        try:
            ensure_synthetic("gemma3-270m:Q4_K_M", tmp_path / "vocab.gguf", tmp_path)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=fill) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(written)) == 2
    assert (tmp_path / "gemma3-270m_Q4_K_M.gguf").read_bytes() == b"whole"
    assert (tmp_path / "gemma3-270m_Q4_K_M.gguf").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma3-270m_Q4_K_M.gguf"]


def test_failed_write_leaves_no_partial(tmp_path: Path, monkeypatch):
    """A write that fails (a full disk) leaves neither a target nor its partial file."""
    import engine.synthetic as synthetic

    def failing_write(path, spec, vocab_path, seed=0):
        Path(path).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(synthetic, "write_synthetic_gguf", failing_write)
    with pytest.raises(OSError, match="No space left"):
        ensure_synthetic("gemma3-270m:Q4_K_M", tmp_path / "vocab.gguf", tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_mxfp4_gpt_oss_20b_layers():
    """gpt-oss as released: MXFP4 experts, the other matrices BF16, every bias, sink, norm
    and the router F32; biases on q/k/v/o, the router and each expert; the MLP's norm named
    post_attention_norm."""
    types = _layer_types("gpt-oss-20b:MXFP4", 201088)
    for i in range(24):
        p = f"blk.{i}."
        for part in ("gate", "up", "down"):
            assert types[p + f"ffn_{part}_exps.weight"] == T.MXFP4, (i, part)
            assert types[p + f"ffn_{part}_exps.bias"] == T.F32, (i, part)
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            assert types[p + part + ".weight"] == T.BF16, (i, part)
            assert types[p + part + ".bias"] == T.F32, (i, part)
        for name in ("attn_sinks.weight", "ffn_gate_inp.weight", "ffn_gate_inp.bias",
                     "post_attention_norm.weight", "attn_norm.weight"):
            assert types[p + name] == T.F32, (i, name)
        assert p + "ffn_norm.weight" not in types
    assert types["output.weight"] == T.BF16 and types["token_embd.weight"] == T.BF16
