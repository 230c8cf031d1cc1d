"""Weight layouts: `ggml` keeps the file's blocks (GGMLLinear, q|k|v and gate|up fused by
type), `bf16` dense matrices, `auto` dense on the CPU. On the CPU the ggml layout runs the
qmatmul reference (dequantize in f32, then matmul), so its logits must match the dense f32
model to float32 rounding; a mis-fused or mis-ordered part would not."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from engine.build import EngineOptions, load_for
from engine.errors import InvalidRequest
from engine.gguf import ModelFile
from engine.kv.pool import SeqPages
from engine.layers.ggml_linear import GGMLLinear
from engine.layers.linear import Linear
from engine.models.weights import WeightLoader
from engine.runner import ForwardBatch, ModelRunner
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

MIXED = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_K, "attn_v.weight": T.Q6_K,
         "attn_output.weight": T.Q8_0, "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K,
         "ffn_down.weight": T.Q6_K, "token_embd.weight": T.Q8_0}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, vocab_dir):
    spec = SyntheticSpec("qwen2", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                         ffn_size=256, num_layers=2, types=MIXED)  # q/k/v biases, tied head
    path = tmp_path_factory.mktemp("layouts") / "tiny.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=11)
    return path


def test_ggml_layout_matches_dense_f32(tiny):
    ggml = load_for(tiny, EngineOptions(device="cpu", dtype="f32", weights="ggml")).model
    dense = load_for(tiny, EngineOptions(device="cpu", dtype="f32", weights="bf16")).model
    blk = ggml.blocks[0]
    assert isinstance(blk.qkv, GGMLLinear) and isinstance(ggml.head, GGMLLinear)
    assert [p.ggml_type for p in blk.qkv.parts] == [T.Q4_K, T.Q6_K]  # q|k merged, v apart
    assert [p.ggml_type for p in blk.gate_up.parts] == [T.Q4_K]
    assert blk.qkv.bias is not None and isinstance(dense.blocks[0].qkv, Linear)
    x = torch.randn(3, 256)
    for a, b in ((blk.qkv, dense.blocks[0].qkv), (blk.down, dense.blocks[0].down),
                 (ggml.head, dense.head)):
        torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)
    ids = torch.tensor([5, 17, 300, 2])
    outs = []
    for model in (ggml, dense):
        runner = ModelRunner(model, 8)
        seq = SeqPages(runner.pool)
        seq.ensure(len(ids))
        batch = ForwardBatch.build([(ids.tolist(), 0)], {"full": [seq.table("full")]},
                                   list(range(len(ids))))
        outs.append(runner.forward(batch))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("table_type", [T.F16, T.BF16])
def test_a_tied_float_table_is_held_once(tmp_path, vocab_dir, table_type):
    """A float token table that is also the head: on the block layouts the head is a BF16
    part over the embedding's own bf16 table (one copy, the head's values the table's),
    and its products are the dense model's; a quantized tied table keeps its blocks."""
    spec = SyntheticSpec("qwen2", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                         ffn_size=256, num_layers=1,
                         types={**MIXED, "token_embd.weight": table_type})
    path = tmp_path / "float_table.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=3)
    for weights in ("ggml", "q8"):
        model = load_for(path, EngineOptions(device="cpu", dtype="bf16", weights=weights)).model
        table = model.embedding.table
        assert table is not None and table.dtype == torch.bfloat16
        (part,) = model.head.parts
        assert part.ggml_type == T.BF16 and part.weight.data_ptr() == table.data_ptr()
        x = torch.randn(3, 256)
        want = x.double() @ table.double().T
        err = (model.head(x).double() - want).abs().max() / want.abs().max()
        assert err < 1e-5, float(err)
    quantized = load_for(tiny_path(tmp_path, vocab_dir), EngineOptions(
        device="cpu", dtype="bf16", weights="ggml")).model
    assert [p.ggml_type for p in quantized.head.parts] == [T.Q8_0]


def tiny_path(tmp_path, vocab_dir):
    spec = SyntheticSpec("qwen2", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                         ffn_size=256, num_layers=1, types=MIXED)
    path = tmp_path / "q8_table.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-spm.gguf", seed=3)
    return path


def test_q8_layout_marks_every_block_linear(tiny):
    """`q8` is the ggml layout with 8-bit activations for Q4_K (engine/layers/ggml_linear.py):
    every fused linear carries the flag; its forward stays near the exact one (x's 8-bit
    quantization: about 1% relative)."""
    q8 = load_for(tiny, EngineOptions(device="cpu", dtype="f32", weights="q8")).model
    dense = load_for(tiny, EngineOptions(device="cpu", dtype="f32", weights="bf16")).model
    blk = q8.blocks[0]
    assert all(isinstance(m, GGMLLinear) and m.act8 for m in (blk.qkv, blk.gate_up, blk.down,
                                                              q8.head))
    x = torch.randn(3, 256)
    a, b = blk.gate_up(x), dense.blocks[0].gate_up(x)
    assert not torch.equal(a, b)  # the Q4_K rows did take the 8-bit path
    assert float((a - b).norm() / b.norm()) < 0.03


def test_auto_is_dense_on_cpu_and_unknown_layouts_fail(tiny):
    mf = ModelFile.open(tiny)
    assert not WeightLoader(mf, torch.bfloat16, "cpu").ggml
    assert WeightLoader(mf, torch.bfloat16, "cpu", "ggml").ggml
    q8 = WeightLoader(mf, torch.bfloat16, "cpu", "q8")
    assert q8.ggml and q8.act8 and not WeightLoader(mf, torch.bfloat16, "cpu", "ggml").act8
    with pytest.raises(InvalidRequest, match="layout"):
        WeightLoader(mf, torch.bfloat16, "cpu", "q4")


def all_logits(model, ids: list[int]) -> torch.Tensor:
    """One prefill of `ids` with every row's logits."""
    runner = ModelRunner(model, 8)
    seq = SeqPages(runner.pool)
    seq.ensure(len(ids))
    batch = ForwardBatch.build([(ids, 0)], {"full": [seq.table("full")]},
                               list(range(len(ids))))
    return runner.forward(batch)


def test_hybrid_layout_is_q8_below_its_threshold_and_bf16_from_it(tiny):
    """`hybrid` (dense_rows 3): a forward of 2 rows is the q8 layout's, of 4 rows the bf16
    layout's, bit for bit (every linear of the step, the tied head included, on one side
    of the threshold)."""
    def model(weights, **kw):
        return load_for(tiny, EngineOptions(device="cpu", dtype="bf16", weights=weights,
                                            **kw)).model

    hybrid, q8, dense = model("hybrid", dense_rows=3), model("q8"), model("bf16")
    blk = hybrid.blocks[0]
    assert all(isinstance(m, GGMLLinear) and m.act8 and m.dense_rows == 3
               for m in (blk.qkv, blk.out, blk.gate_up, blk.down, hybrid.head))
    short, long = [5, 17], [5, 17, 300, 2]
    a, b = all_logits(hybrid, short), all_logits(q8, short)
    assert torch.equal(a, b) and not torch.equal(a, all_logits(dense, short))
    a, b = all_logits(hybrid, long), all_logits(dense, long)
    assert torch.equal(a, b) and not torch.equal(a, all_logits(q8, long))


def test_hybrid_needs_its_threshold_and_only_it(tiny):
    mf = ModelFile.open(tiny)
    with pytest.raises(InvalidRequest, match="dense_rows"):
        WeightLoader(mf, torch.bfloat16, "cpu", "hybrid")
    with pytest.raises(InvalidRequest, match="dense_rows"):
        WeightLoader(mf, torch.bfloat16, "cpu", "q8", dense_rows=4)
    with pytest.raises(InvalidRequest, match="at least 1"):
        WeightLoader(mf, torch.bfloat16, "cpu", "hybrid", dense_rows=0)
    with pytest.raises(InvalidRequest, match="copies are bf16"):
        WeightLoader(mf, torch.float32, "cpu", "hybrid", dense_rows=4)
    with pytest.raises(InvalidRequest, match="measures its threshold on a GPU"):
        load_for(tiny, EngineOptions(device="cpu", weights="hybrid"))
    with pytest.raises(InvalidRequest, match="hybrid"):
        load_for(tiny, EngineOptions(device="cpu", weights="ggml", dense_rows=4))
    with pytest.raises(InvalidRequest, match="hybrid"):  # auto's CPU load too, not ignored
        load_for(tiny, EngineOptions(device="cpu", weights="auto", dense_rows=4))
