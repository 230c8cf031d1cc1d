"""One stream's bandwidth bound (engine/bench/bound.py, engine/planner.py's
decode_read_bytes): the bytes a token reads counted here independently, from gguf-py's
reader and the KV formats' block sizes written out by hand."""

from __future__ import annotations

import math

import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader

from engine.bench.bound import copy_rate_gb_s, decode_bound, share_of_bound
from engine.gguf import ModelFile
from engine.models.registry import read_config
from engine.planner import decode_read_bytes
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

TYPES = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q8_0, "attn_v.weight": T.Q6_K,
         "attn_output.weight": T.Q4_K, "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K,
         "ffn_down.weight": T.Q6_K, "token_embd.weight": T.Q8_0, "output.weight": T.Q6_K}
LAYERS, KV_HEADS, HEAD_DIM = 3, 2, 64
# K + V bytes of one position of one layer's one element pair, by hand from the formats'
# blocks: f16 2 + 2; q8_0 (34 bytes a 32) twice; q8_0 K and q4_0 V (18 bytes a 32)
KV_PAIR = {"f16": 4.0, "q8": 2 * 34 / 32, "k8v4": 34 / 32 + 18 / 32}


def _tensor_bytes(path) -> tuple[dict[str, int], int]:
    """gguf-py's bytes of each tensor, and the token table's rows (its reader parses the
    vocabulary for seconds: once a file)."""
    tensors = GGUFReader(path).tensors
    table = next(t for t in tensors if t.name == "token_embd.weight")
    return {t.name: int(t.n_bytes) for t in tensors}, int(table.shape[-1])


@pytest.fixture(scope="module", params=["head", "tied"])
def model(request, tmp_path_factory, vocab_dir):
    tied = request.param == "tied"
    spec = SyntheticSpec("llama", hidden_size=256, num_heads=8, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, ffn_size=768, num_layers=LAYERS, types=TYPES,
                         tied_embeddings=tied)
    path = tmp_path_factory.mktemp("bound") / f"{request.param}.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
    return path, tied, _tensor_bytes(path)


@pytest.mark.parametrize("kv_quant", ["f16", "q8", "k8v4"])
@pytest.mark.parametrize("context", [1, 96, 1000])
def test_decode_read_bytes_counts_weights_once_a_table_row_and_the_kv(model, kv_quant,
                                                                       context):
    path, tied, (sizes, vocab) = model
    sizes = dict(sizes)
    table = sizes.pop("token_embd.weight")
    # a tied head reads the whole table; else the head is output.weight and one row is read
    want = sum(sizes.values()) + (table if tied else table // int(vocab))
    want += round(LAYERS * context * KV_HEADS * HEAD_DIM * KV_PAIR[kv_quant])
    with ModelFile.open(path) as mf:
        assert decode_read_bytes(mf, read_config(mf), context, kv_quant) == want
    assert ("output.weight" in sizes) != tied


def test_sliding_layers_read_their_window_only(default_model_path):
    """The embedded Gemma 3 (sliding layers of a 512-token window beside full ones): past
    the window only the full layers' KV grows."""
    with ModelFile.open(default_model_path) as mf:
        cfg = read_config(mf)
        sliding = [i for i in range(cfg.num_layers) if cfg.is_sliding(i)]
        assert cfg.sliding_window and 0 < len(sliding) < cfg.num_layers
        w = cfg.sliding_window
        per_position = cfg.num_kv_heads * cfg.head_dim * 4  # f16 K and V, one layer
        at = {c: decode_read_bytes(mf, cfg, c, "f16") for c in (w, w + 100, w + 300)}
    full = cfg.num_layers - len(sliding)
    assert at[w + 100] - at[w] == 100 * full * per_position
    assert at[w + 300] - at[w + 100] == 200 * full * per_position
    with pytest.raises(ValueError, match="context"):
        decode_read_bytes(mf, cfg, 0, "f16")


def test_bound_and_share(model):
    path = model[0]
    with ModelFile.open(path) as mf:
        cfg = read_config(mf)
        bound = decode_bound(mf, cfg, 96, "f16", rate_gb_s=4000.0)
        nbytes = decode_read_bytes(mf, cfg, 96, "f16")
    assert bound["token_bytes"] == nbytes
    assert math.isclose(bound["bound_tok_s"], 4000e9 / nbytes, rel_tol=1e-3)
    assert share_of_bound(bound["bound_tok_s"] * 0.6, bound) == pytest.approx(60.0, abs=0.1)


def test_copy_rate_is_a_measured_positive_rate():
    """On the CPU: 64 MiB copied (read + write counted); any machine moves more than
    0.1 GB/s and less than 10 TB/s."""
    rate = copy_rate_gb_s("cpu", 64 << 20, repeats=3)
    assert 0.1 < rate < 10_000


def test_a_moe_token_reads_its_share_of_the_experts(tmp_path, vocab_dir):
    """qwen3moe: a token reads experts_used of the E experts of each expert tensor (and the
    router whole), counted from gguf-py's bytes."""
    spec = SyntheticSpec("qwen3moe", hidden_size=256, num_heads=8, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, ffn_size=768, num_layers=LAYERS, num_experts=8,
                         experts_used=3, expert_ffn_size=256,
                         types={"ffn_gate_exps.weight": T.Q4_K, "ffn_down_exps.weight": T.Q6_K,
                                **TYPES})
    path = tmp_path / "moe.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
    sizes, _ = _tensor_bytes(path)
    table = sizes.pop("token_embd.weight")  # tied: the head is the table
    experts = sum(v for k, v in sizes.items() if "_exps." in k)
    want = sum(sizes.values()) - experts + experts * 3 // 8 + table
    want += LAYERS * 96 * KV_HEADS * HEAD_DIM * 4
    with ModelFile.open(path) as mf:
        assert decode_read_bytes(mf, read_config(mf), 96, "f16") == want


def test_a_gpt_oss_token_reads_its_experts_share_and_its_window(tmp_path, vocab_dir):
    """gpt-oss: experts_used of the E experts and of their (E, N) biases, every 1-D tensor
    (sinks, the router's bias), one row of the untied table, and the sliding layers'
    window of keys (layer 0 and 2 of 3: 8 keys; layer 1: all 96)."""
    spec = SyntheticSpec("gpt-oss", hidden_size=256, num_heads=8, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, ffn_size=768, num_layers=LAYERS, num_experts=8,
                         experts_used=3, expert_ffn_size=256, sliding_window=8,
                         tied_embeddings=False,
                         types={"ffn_gate_exps.weight": T.MXFP4, "ffn_up_exps.weight": T.MXFP4,
                                "ffn_down_exps.weight": T.MXFP4, **TYPES})
    path = tmp_path / "oss.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
    sizes, rows = _tensor_bytes(path)
    table = sizes.pop("token_embd.weight")
    experts = sum(v for k, v in sizes.items() if "_exps." in k)
    want = sum(sizes.values()) - experts + experts * 3 // 8 + table // rows
    want += (8 + 96 + 8) * KV_HEADS * HEAD_DIM * 4
    with ModelFile.open(path) as mf:
        assert decode_read_bytes(mf, read_config(mf), 96, "f16") == want


def test_a_moe_chunk_plans_its_pairs_activations_and_inspect_names_the_experts(
        tmp_path, vocab_dir):
    """A MoE chunk's working memory grows with its experts_used (token, expert) pairs, not
    one MLP (the memory plan would undercount it k times); `inspect` reports the experts."""
    from engine.inspect import inspect_model
    from engine.planner import prefill_working_bytes

    base = dict(hidden_size=256, num_heads=8, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                ffn_size=768, num_layers=1, num_experts=8, expert_ffn_size=256)
    sizes = {}
    for used in (1, 4):
        path = tmp_path / f"moe{used}.gguf"
        write_synthetic_gguf(path, SyntheticSpec("qwen3moe", experts_used=used, **base),
                             vocab_dir / "ggml-vocab-llama-spm.gguf", seed=5)
        with ModelFile.open(path) as mf:
            sizes[used] = prefill_working_bytes(read_config(mf), 100)
        info = inspect_model(path)
        assert (info["experts"], info["experts_used"], info["ffn_size"]) == (8, used, 256)
    # three f32 activations of 256 and the expert's 256-wide output a pair, 100 tokens
    assert sizes[4] - sizes[1] == 4 * 100 * 3 * (3 * 256 + 256)
