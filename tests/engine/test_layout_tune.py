"""`--weights auto` on a GPU: the layout chosen from measured cost (engine/layout_tune.py).

The choice is tested here with a fake clock (the GPU measurement itself runs in
tests/engine/test_gpu_paths.py): shapes counted from the file, each weighed by how many
linears have it, the tie going to the blocks, memory checked before speed."""

from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as T

from appliance.cli.main import main as cli_main
from engine.build import EngineOptions, load_for
from engine.errors import InvalidRequest
from engine.gguf import ModelFile
from engine.inspect import inspect_model
from engine.layout_tune import (
    HYBRID_ROWS,
    choose_dense_rows,
    choose_layout,
    linear_shapes,
    tune_rows,
)
from engine.models.registry import read_config
from engine.planner import plan
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

TYPES = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q8_0, "attn_v.weight": T.Q6_K,
         "attn_output.weight": T.Q4_K, "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K,
         "ffn_down.weight": T.Q6_K, "token_embd.weight": T.Q8_0, "output.weight": T.Q6_K}
H, Q, KV, F, LAYERS = 256, 8 * 64, 2 * 64, 768, 3


def _write(tmp_path_factory, vocab_dir, tied: bool):
    spec = SyntheticSpec("llama", hidden_size=H, num_heads=8, num_kv_heads=2, head_dim=64,
                         ffn_size=F, num_layers=LAYERS, types=TYPES, tied_embeddings=tied)
    path = tmp_path_factory.mktemp("tune") / f"{'tied' if tied else 'head'}.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=3)
    return path


@pytest.fixture(scope="module")
def with_head(tmp_path_factory, vocab_dir):
    return _write(tmp_path_factory, vocab_dir, tied=False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory, vocab_dir):
    return _write(tmp_path_factory, vocab_dir, tied=True)


def test_linear_shapes_count_each_layer_and_the_head(with_head, tied):
    with ModelFile.open(with_head) as mf:
        shapes = {(s.ggml_type, s.out_features, s.in_features): s.count
                  for s in linear_shapes(mf)}
        vocab = mf.tensors["output.weight"].shape[0]
    assert shapes == {
        (T.Q4_K, Q, H): LAYERS, (T.Q8_0, KV, H): LAYERS, (T.Q6_K, KV, H): LAYERS,
        (T.Q4_K, H, Q): LAYERS, (T.Q4_K, F, H): 2 * LAYERS, (T.Q6_K, H, F): LAYERS,
        (T.Q6_K, vocab, H): 1}
    with ModelFile.open(tied) as mf:  # no output.weight: the token table is the head
        shapes = {(s.ggml_type, s.out_features): s.count for s in linear_shapes(mf)}
    assert shapes[(T.Q8_0, vocab)] == 1 and (T.Q6_K, vocab) not in shapes


def type_weight(ggml_type: int) -> float:
    """The fake clock's Q6_K elements cost a tenth (so that the Q4_K linears, not the
    large head, decide between the two blocks layouts)."""
    return 0.1 if ggml_type == T.Q6_K else 1.0


def clock(per_element_ns: dict[str, float]):
    """A fake Measure: time proportional to the weight's elements and the rows, per layout
    and type; records its calls."""
    calls: list[tuple] = []

    def measure(layout, ggml_type, n, k, m):
        calls.append((layout, ggml_type, n, k, m))
        return per_element_ns[layout] * type_weight(ggml_type) * 1e-9 * n * k * (1 + m / 16)

    return measure, calls


def choose(path, measure, budget=None, **kw):
    with ModelFile.open(path) as mf:
        cfg = read_config(mf)
        return choose_layout(mf, cfg, sessions=kw.get("sessions", 4),
                             context=kw.get("context", 256), kv_quant="f16",
                             budget_bytes=budget, measure=measure), linear_shapes(mf)


@pytest.mark.parametrize("bf16_ns,q8_ns,expected", [(0.5, 1.0, "bf16"), (0.97, 1.0, "ggml"),
                                                     (1.5, 1.0, "ggml"), (1.5, 0.5, "q8"),
                                                     (1.5, 0.97, "ggml"), (0.3, 0.5, "bf16")])
def test_the_faster_layout_wins_and_a_near_tie_keeps_the_blocks(with_head, bf16_ns, q8_ns,
                                                                  expected):
    """bf16 against the better blocks layout, q8 against ggml, each only when more than 5%
    faster; q8 is timed on its own kernels' shapes only (Q4_K, Q6_K), the rest (Q8_0)
    count as ggml's."""
    measure, calls = clock({"ggml": 1.0, "bf16": bf16_ns, "q8": q8_ns})
    choice, shapes = choose(with_head, measure)
    assert choice.layout == expected
    # every distinct shape timed once per layout and row count, weighed by its count
    assert tune_rows(4) == (1, 4, 16)  # choose's default: 4 sessions
    want_calls = [(lay, s.ggml_type, s.out_features, s.in_features, m)
                  for lay in ("ggml", "q8", "bf16") for s in shapes for m in (1, 4, 16)
                  if lay != "q8" or s.ggml_type in (T.Q4_K, T.Q6_K)]
    assert sorted(calls) == sorted(want_calls)
    for layout, ns in (("ggml", 1.0), ("bf16", bf16_ns), ("q8", None)):
        for m in (1, 4, 16):
            want = sum(s.count * (ns or (q8_ns if s.ggml_type in (T.Q4_K, T.Q6_K) else 1.0))
                       * 1e-6
                       * type_weight(s.ggml_type) * s.out_features * s.in_features
                       * (1 + m / 16) for s in shapes)
            assert choice.forward_ms[layout][m] == pytest.approx(want)
    assert all(name in choice.reason for name in ("bf16", "ggml", "q8"))


def test_the_score_is_one_row_plus_the_sessions_full_batch(with_head):
    """q8 fast at one row and slow at many, bf16 flat: few sessions take q8, a box set up
    for many takes bf16; more than 16 sessions are judged at 16 rows."""
    calls: list[tuple] = []
    per_row = {"ggml": (1.0, 0.5), "q8": (0.4, 0.5), "bf16": (0.8, 0.02)}  # ns at 1, + a row

    def measure(layout, ggml_type, n, k, m):
        calls.append(m)
        first, more = per_row[layout]
        return (first + more * (m - 1)) * 1e-9 * n * k

    for sessions, rows, layout in ((1, (1, 16), "q8"), (2, (1, 2, 16), "q8"),
                                   (8, (1, 8, 16), "bf16"), (64, (1, 16), "bf16")):
        calls.clear()
        choice, _ = choose(with_head, measure, sessions=sessions)
        assert tune_rows(sessions) == rows and sorted(set(calls)) == list(rows)
        assert choice.layout == layout, (sessions, choice.reason)
        assert f"1 + {min(sessions, 16)} rows" in choice.reason


def test_bf16_that_does_not_fit_is_not_measured(with_head):
    """The blocks' two layouts are still timed against each other."""
    measure, calls = clock({"ggml": 1.0, "bf16": 0.1, "q8": 0.5})
    with ModelFile.open(with_head) as mf:
        need = plan(mf, read_config(mf), sessions=4, context=256, kv_quant="f16",
                    backend="cpu").total_bytes
    choice, _ = choose(with_head, measure, budget=need - 1)
    assert choice.layout == "q8" and "exceed" in choice.reason
    assert {c[0] for c in calls} == {"ggml", "q8"} and "bf16" not in choice.forward_ms
    assert choice.total_bytes["bf16"] == need > choice.total_bytes["ggml"]
    assert choice.total_bytes["q8"] == choice.total_bytes["ggml"]
    fits, _ = choose(with_head, measure, budget=need)
    assert fits.layout == "bf16"
    assert fits.as_dict()["forward_ms"]["bf16"]["1"] > 0


def test_auto_on_the_cpu_loads_dense_without_measuring(with_head, monkeypatch):
    import engine.layout_tune as tune

    monkeypatch.setattr(tune, "choose_layout", lambda *a, **k: pytest.fail("measured"))
    loaded = load_for(with_head, EngineOptions(device="cpu", dtype="f32"))
    assert loaded.layout_choice is None


def test_inspect_measures_only_on_a_gpu(with_head, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "weight_layout" not in inspect_model(with_head)  # the file only
    assert "weight_layout" not in inspect_model(with_head, "auto")  # no GPU: the file only
    with pytest.raises(InvalidRequest, match="GPU"):
        inspect_model(with_head, "cuda")
    assert cli_main(["inspect", str(with_head), "--device", "auto", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"architecture"' in out and "weight_layout" not in out


def hybrid_choice(path, measure, budget=None):
    with ModelFile.open(path) as mf:
        return choose_dense_rows(mf, read_config(mf), sessions=64, context=256,
                                 kv_quant="f16", budget_bytes=budget, measure=measure)


@pytest.mark.parametrize("bf16_wins_at,expected", [
    ((32, 64, 128, 512), 32),
    ((16, 64, 128, 512), 64),  # a win at 16 but not at 32: from 64 on
    ((4, 8, 16, 32, 64, 128, 512), 4),
    ((8, 16, 32, 64, 128), None),  # lost at the largest count: never from a count on
    ((), None)])
def test_hybrid_threshold_is_where_the_copies_win_for_good(with_head, bf16_wins_at, expected):
    """The copies win at a row count when every linear of one forward together takes more
    than 5% less; the threshold is the first count from which they win at every larger one.
    q8 is timed on its kernels' types (Q4_K, Q6_K), ggml's kernels on the others (Q8_0)."""
    calls: list[tuple] = []

    def measure(layout, ggml_type, n, k, m):
        calls.append((layout, ggml_type, m))
        blocks = 1e-9 * n * k * m
        return blocks * (0.9 if m in bf16_wins_at else 0.96) if layout == "bf16" else blocks

    choice = hybrid_choice(with_head, measure)
    assert choice.dense_rows == expected
    assert choice.layout == ("q8" if expected is None else "hybrid")
    assert sorted({c[2] for c in calls}) == list(HYBRID_ROWS)
    assert {(c[0], c[1]) for c in calls} == {
        ("q8", T.Q4_K), ("q8", T.Q6_K), ("ggml", T.Q8_0),
        ("bf16", T.Q4_K), ("bf16", T.Q6_K), ("bf16", T.Q8_0)}
    assert set(choice.forward_ms) == {"q8", "bf16"}
    assert choice.as_dict()["dense_rows"] == expected


def test_hybrid_that_does_not_fit_keeps_q8_unmeasured(with_head):
    with ModelFile.open(with_head) as mf:
        cfg = read_config(mf)
        need = plan(mf, cfg, sessions=64, context=256, kv_quant="f16",
                    backend="hybrid").total_bytes
    choice = hybrid_choice(with_head, lambda *a: pytest.fail("measured"), budget=need - 1)
    assert choice.layout == "q8" and choice.dense_rows is None and "exceed" in choice.reason
    fits = hybrid_choice(with_head, lambda layout, t, n, k, m: (0.5 if layout == "bf16"
                                                                  else 1.0) * n * k * 1e-9,
                         budget=need)
    assert fits.layout == "hybrid" and fits.dense_rows == HYBRID_ROWS[0]
    assert fits.total_bytes["hybrid"] == need


def test_inspect_on_a_gpu_reports_auto_and_hybrid_choices(with_head, monkeypatch):
    """The measurement itself stands in (a fake clock: bf16 copies win from 64 rows)."""
    import torch

    import engine.kernel_select as kernel_select
    import engine.layout_tune as tune
    import engine.tile_tune as tile_tune

    def measure(layout, ggml_type, n, k, m):
        return 1e-9 * n * k * (0.5 if layout == "bf16" and m >= 64 else 1.0) * (1 + m / 16)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_select, "use_triton", lambda device=None: True)
    monkeypatch.setattr(tune, "gpu_measure", lambda device: measure)
    monkeypatch.setattr(tune, "free_memory_budget", lambda device: 1 << 40)
    monkeypatch.setattr(tile_tune, "tune_tiles", lambda mf, dev: None)
    layout = inspect_model(with_head, "cuda", sessions=64)["weight_layout"]
    assert layout["layout"] in ("ggml", "q8") and layout["dense_rows"] is None
    assert layout["hybrid"]["layout"] == "hybrid" and layout["hybrid"]["dense_rows"] == 64
    assert set(layout["hybrid"]["forward_ms"]) == {"q8", "bf16"}


def test_hybrid_plan_counts_a_bf16_copy_of_every_linear(with_head, tied, capsys):
    """The copies are the linears' matrices (linear_shapes: the token table only as a
    tied head), two bytes an element, beside the blocks."""
    from engine.planner import dense_copy_bytes, weights_bytes

    for path in (with_head, tied):
        with ModelFile.open(path) as mf:
            cfg = read_config(mf)
            want = sum(2 * s.count * s.out_features * s.in_features
                       for s in linear_shapes(mf))
            assert dense_copy_bytes(mf) == want
            assert weights_bytes(mf, cfg, "hybrid") == weights_bytes(mf, cfg, "gpu") + want
            with pytest.raises(ValueError, match="backend"):
                weights_bytes(mf, cfg, "tpu")
    assert cli_main(["plan", str(with_head), "--backend", "hybrid", "--kv-quant", "f16",
                     "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with ModelFile.open(with_head) as mf:
        assert out["weights_bytes"] == weights_bytes(mf, read_config(mf), "hybrid")


def test_float_linears_count_as_bf16_and_have_no_second_copy(tmp_path, vocab_dir):
    """A GPU holds F32/F16 matrices in bf16 (two bytes an element), and the hybrid layout's
    copy of a float matrix is that tensor: no copy is counted for it."""
    from engine.planner import dense_copy_bytes, weights_bytes

    types = {**TYPES, "attn_output.weight": T.F32, "output.weight": T.F16}
    spec = SyntheticSpec("llama", hidden_size=H, num_heads=8, num_kv_heads=2, head_dim=64,
                         ffn_size=F, num_layers=LAYERS, types=types, tied_embeddings=False)
    path = tmp_path / "floats.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=3)
    with ModelFile.open(path) as mf:
        cfg = read_config(mf)
        floats = {"output.weight"} | {f"blk.{i}.attn_output.weight" for i in range(LAYERS)}
        assert {mf.tensors[n].ggml_type for n in floats} == {T.F32, T.F16}
        blocks = sum(t.n_bytes for n, t in mf.tensors.items() if n not in floats)
        assert weights_bytes(mf, cfg, "gpu") == blocks + 2 * (LAYERS * H * Q + cfg.vocab_size * H)
        quantized = [s for s in linear_shapes(mf) if s.ggml_type not in (T.F32, T.F16)]
        assert dense_copy_bytes(mf) == sum(2 * s.count * s.out_features * s.in_features
                                           for s in quantized)


def test_a_moe_model_keeps_its_blocks_however_fast_bf16_times(tmp_path, vocab_dir):
    """qwen3moe: its experts are not timed (they are not 2-D linears), so bf16 is not
    offered even when its attention linears time fastest in it."""
    spec = SyntheticSpec("qwen3moe", hidden_size=H, num_heads=8, num_kv_heads=2, head_dim=64,
                         ffn_size=F, num_layers=1, num_experts=4, experts_used=2,
                         expert_ffn_size=256, types=TYPES)
    path = tmp_path / "moe.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / "ggml-vocab-llama-bpe.gguf", seed=3)
    measure, calls = clock({"ggml": 1.0, "bf16": 0.1, "q8": 1.0})
    choice, _ = choose(path, measure)
    assert choice.layout == "ggml" and "MoE" in choice.reason
    assert not any(c[0] == "bf16" for c in calls)
