"""The GPU path (Triton qmatmul and paged attention, CUDA graphs of decode steps) against
the CPU path (dense f32 weights, torch attention) on tiny GGUFs, for the GPU weight
layouts with graphs on and off; and graph replays against eager decode on the GPU.
Runs on the lent GPU machine (`pytest -m gpu`), never in CI.

The ggml layout rounds activations to bf16 inside qmatmul, q8 quantizes them to 8 bits
for Q4_K (kernels/qint.py) and the bf16 layout rounds the weights, so GPU logits differ
from the f32 CPU logits by a few 1e-3 relative (q8: 1-7%); greedy tokens must agree
except after a near tie of the CPU's own top two logits.
"""

from __future__ import annotations

import pytest
import torch
from forced_routes import ForcedRoutes
from span_batch import span_batch

from engine.batch import ForwardBatch
from engine.build import EngineOptions, build_core, load_for
from engine.kv.pool import SeqPages
from engine.runner import ModelRunner
from engine.sampler import SamplingParams
from engine.scheduler.request import Request
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

pytestmark = pytest.mark.gpu
T = __import__("gguf").GGMLQuantizationType
MIXED = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_K, "attn_v.weight": T.Q6_K,
         "attn_output.weight": T.Q8_0, "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K,
         "ffn_down.weight": T.Q6_K, "token_embd.weight": T.Q8_0,
         "ffn_gate_exps.weight": T.Q4_K, "ffn_up_exps.weight": T.Q4_K,
         "ffn_down_exps.weight": T.Q6_K}
SPECS = {
    "llama": (SyntheticSpec("llama", hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                            ffn_size=512, num_layers=3, types=MIXED),
              "ggml-vocab-llama-bpe.gguf"),
    # the grouped expert kernels in every path below (graphs, mixed steps, invariance)
    "qwen3moe": (SyntheticSpec("qwen3moe", hidden_size=256, num_heads=4, num_kv_heads=2,
                               head_dim=64, ffn_size=512, num_layers=3, num_experts=8,
                               experts_used=2, expert_ffn_size=256, types=MIXED),
                 "ggml-vocab-llama-bpe.gguf"),
    # MXFP4 experts with biases and the clamped SwiGLU, sinks, YaRN, every other layer
    # sliding (the kernels' gpt-oss paths)
    "gpt-oss": (SyntheticSpec("gpt-oss", hidden_size=256, num_heads=4, num_kv_heads=2,
                              head_dim=64, ffn_size=512, num_layers=3, num_experts=8,
                              experts_used=2, expert_ffn_size=256, sliding_window=16,
                              tied_embeddings=False, yarn_factor=4.0, yarn_original_context=64,
                              types={**{k: v for k, v in MIXED.items() if "exps" not in k},
                                     **{f"ffn_{n}_exps.weight": T.MXFP4
                                        for n in ("gate", "up", "down")}}),
                "ggml-vocab-llama-bpe.gguf"),
    "gemma3": (SyntheticSpec("gemma3", hidden_size=256, num_heads=4, num_kv_heads=1,
                             head_dim=64, ffn_size=512, num_layers=6, sliding_window=16,
                             types=MIXED), "ggml-vocab-llama-spm.gguf"),
}
# Activations rounded to bf16 (ggml: inside qmatmul) or bf16 weights move these random
# models' logits (std ~0.6) by 1-2% relative (measured on the CPU by emulating the
# rounding); f16 attention operands add ~3e-4. A wrong plan or slot moves them by O(1).
MAX_REL = 5e-2
# q8's 8-bit activations move a linear's output by ~0.7-3% (README); over gemma3's six
# layers the prefill step's logits measured 0.049 (bf16 token table) and 0.067 (the exact
# table, 9e321e6) against the CPU's on the H200; a wrong row or plan moves them by O(1)
# (0.77 with ids read at the wrong stride).
MAX_REL_Q8 = 0.1
NEAR_TIE = 0.1  # CPU top-1 minus top-2 logit below which a GPU choice may differ
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(SPECS))
def tiny(request, tmp_path_factory, vocab_dir):
    if not torch.cuda.is_available():
        pytest.fail("marked gpu: run on a GPU machine with pytest -m gpu")
    spec, vocab = SPECS[request.param]
    path = tmp_path_factory.mktemp("gpu") / f"{request.param}.gguf"
    write_synthetic_gguf(path, spec, vocab_dir / vocab, seed=7)
    return path


def opts(device: str, weights: str, graphs: bool, kv_quant: str = "f16") -> EngineOptions:
    """`weights` "hybridN": the hybrid layout with its bf16 copies from N rows."""
    dense_rows = int(weights[6:]) if weights.startswith("hybrid") and weights[6:] else None
    return EngineOptions(sessions=6, context=256, prefill_chunk=64, device=device,
                         dtype="f32" if device == "cpu" else "bf16",
                         weights="hybrid" if dense_rows else weights, dense_rows=dense_rows,
                         cuda_graphs=graphs, kv_quant=kv_quant, max_pending_per_client=None)


def generate(path, options: EngineOptions, prompts: list[list[int]]):
    """Greedy tokens of every prompt, run together, and the logits rows sampled from
    (through a wrapped runner.forward)."""
    core = build_core(load_for(path, options), options)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        core.add(Request(f"r{i}", tuple(p), PARAMS))
    while core.has_work():
        for chunk in core.step():
            tokens[chunk.request_id].extend(chunk.token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))], core


def cpu_logits(path, prompt: list[int], tokens: list[int], routes_of: EngineOptions | None = None,
               forced: ForcedRoutes | None = None) -> torch.Tensor:
    """The CPU's logits before each of `tokens` (teacher-forced, one prefill). `routes_of`
    (a GPU layout's options) and `forced`: along the routing that this layout's path takes
    on the same tokens, run first."""
    ids = prompt + tokens
    rows = list(range(len(prompt) - 1, len(ids) - 1))

    def prefill(runner: ModelRunner) -> torch.Tensor:
        seq = SeqPages(runner.pool)
        seq.ensure(len(ids))
        return runner.forward(ForwardBatch.build([(ids, 0)], {g: [seq.table(g)] for g in
                                                               runner.pool.groups}, rows))

    if routes_of is not None:
        runner = ModelRunner(load_for(path, routes_of).model, 64)
        forced.clear()  # routes of the load's own forwards (a hybrid layout's timing)
        prefill(runner)
    return prefill(ModelRunner(load_for(path, opts("cpu", "bf16", False)).model, 64)).cpu()


def prompts_for(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(100, 20000, (int(k),), generator=gen).tolist()
            for k in torch.randint(3, 90, (n,), generator=gen)]


def test_q8_load_tunes_its_tiles(tiny, tmp_path):
    """A q8 load times the matrix-unit tiles on the model's Q4_K and Q6_K shapes
    (engine/tile_tune.py): a candidate for every type and row bound but those the Gluon
    kernel takes (gluon_bounds: 16 rows on NVIDIA), none failed, and the launches take
    the choice; the next load takes it from the cache file untimed; with tune_tiles off
    nothing is timed."""
    from dataclasses import replace

    from engine.tile_tune import gluon_bounds
    from kernels.qint import Q6_K_A
    from kernels.qint_mm import TILE_BOUNDS, TILE_CANDIDATES, tiled_tile

    cached = replace(opts("cuda", "q8", True), tile_cache=str(tmp_path / "q8_tiles.json"))
    loaded = load_for(tiny, cached)
    choice = loaded.tile_choice
    assert choice is not None and not choice.errors and not choice.cached, choice
    again = load_for(tiny, cached).tile_choice
    assert again.cached and again.tiles == choice.tiles
    held = {int(T.Q4_K), Q6_K_A}
    skipped = gluon_bounds(held, choice.backend, torch.device("cuda"))
    assert set(choice.skipped) == skipped and not set(choice.tiles) & skipped
    assert set(choice.tiles) | skipped == {(t, b) for t in held for b in TILE_BOUNDS}
    for (held, bound), tile in choice.tiles.items():
        assert tile in TILE_CANDIDATES[choice.backend][bound]
        assert tiled_tile(min(bound, 512), choice.backend, held) == tile
    assert load_for(tiny, replace(opts("cuda", "q8", True), tune_tiles=False)).tile_choice \
        is None


@pytest.mark.parametrize("weights", ["ggml", "q8", "bf16", "hybrid4"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_gpu_greedy_tokens_match_cpu(tiny, weights, graphs, monkeypatch):
    """Where a GPU token differs from the CPU's, the CPU's own top two must be a near tie
    there (teacher-forced on the CPU's tokens). MoE families: the CPU's logits along the
    routing the GPU path takes on those tokens (forced_routes.py); there the GPU's token
    may also be the CPU's choice outright."""
    prompts = prompts_for(5)  # five rows: graph bucket 8 with padding, then fewer
    cpu, _ = generate(tiny, opts("cpu", "bf16", False), prompts)
    gpu, core = generate(tiny, opts("cuda", weights, graphs), prompts)
    graphs_of = core.runner.graphs
    assert (graphs_of is not None and graphs_of.num_replays > 0) == graphs
    assert (core.num_ahead_steps > 0) == graphs  # look-ahead steps replay graphs
    forced = ForcedRoutes(monkeypatch) if core.runner.model.cfg.num_experts else None
    for prompt, a, b in zip(prompts, cpu, gpu, strict=True):
        if a == b:
            continue
        first = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        routes_of = None if forced is None else opts("cuda", weights, False)
        logits = cpu_logits(tiny, prompt, a, routes_of, forced)[first]
        assert forced is None or not forced.pending
        top = logits.topk(2)
        gap = float(top.values[0] - top.values[1])
        assert gap < NEAR_TIE or (forced is not None and int(top.indices[0]) == b[first]), \
            f"GPU token {b[first]} != CPU {a[first]} at {first}, gap {gap}"


@pytest.mark.parametrize("weights", ["ggml", "q8", "bf16", "hybrid2", "hybrid8"])
def test_gpu_logits_close_to_cpu(tiny, weights, monkeypatch):
    """Teacher-forced: one prefill step of 4 prompts, then decode steps (graph replays).
    f16 KV: with q4/q8 KV, codes flip on these differences and the logits move further
    (quantized KV on the GPU: test_graph_replay_is_bit_equal_to_eager and the interpreter
    tests in tests/engine/layers). MoE families: the CPU takes the GPU's routing (experts
    and weights; tests/engine/forced_routes.py: the tiny router is ill-conditioned), so
    the GPU runs eagerly, where its routing's Python runs; its graph replays give the
    eager bits (test_graph_replay_is_bit_equal_to_eager,
    test_mixed_graph_captured_when_idle_replays_the_eager_bits)."""
    kv_quant = "f16"
    models = [load_for(tiny, o).model for o in (opts("cpu", "bf16", False),
                                                 opts("cuda", weights, True))]
    moe = models[0].cfg.num_experts > 0
    runners = [ModelRunner(m, 96, 16, kv_quant, cuda_graphs=not moe, max_context=256)
               for m in models]
    forced = ForcedRoutes(monkeypatch) if moe else None  # after every load and runner
    seqs = [[SeqPages(r.pool) for _ in range(4)] for r in runners]
    spans = [(i, p) for i, p in enumerate(prompts_for(4))]
    for _ in range(6):
        logits = []
        for runner, pages in reversed(list(zip(runners, seqs, strict=True))):  # GPU first
            logits.append(runner.forward(span_batch(runner, pages, spans)).cpu())
        b, a = logits
        assert forced is None or (not forced.pending and forced.num_recorded > 0)
        rel = (a - b).norm() / a.norm()
        bound = MAX_REL_Q8 if weights == "q8" or weights.startswith("hybrid") else MAX_REL
        assert torch.isfinite(b).all() and rel < bound, float(rel)
        spans = [(i, [t]) for i, t in enumerate(a.argmax(-1).tolist())]
    assert moe or (runners[1].graphs is not None and runners[1].graphs.num_replays == 5)


@pytest.mark.parametrize("kv_quant", ["f16", "k8v4"])
def test_graph_replay_is_bit_equal_to_eager(tiny, kv_quant):
    model = load_for(tiny, opts("cuda", "ggml", True)).model
    runner = ModelRunner(model, 96, 16, kv_quant, cuda_graphs=True, max_context=256)
    seqs = [SeqPages(runner.pool) for _ in range(4)]
    prompts = prompts_for(4)
    for s, p in zip(seqs, prompts, strict=True):
        s.ensure(len(p) + 1)
    tables = {g: [s.table(g) for s in seqs] for g in runner.pool.groups}
    runner.forward(ForwardBatch.build([(p, 0) for p in prompts], tables))
    decode = ForwardBatch.build([([7 + i], len(p)) for i, p in enumerate(prompts)], tables)
    graphed = runner.forward(decode)  # captures bucket 4, then replays it
    assert runner.graphs.captured == (4,) and runner.graphs.num_replays == 1
    # The same step again writes the same K/V to the same slots: eager must agree exactly.
    assert torch.equal(graphed, runner.forward_eager(decode))
    assert torch.equal(graphed, runner.forward(decode))
    three = ForwardBatch.build([([7 + i], len(p)) for i, p in enumerate(prompts[:3])],
                               {g: t[:3] for g, t in tables.items()})
    padded = runner.forward(three)  # bucket 4 with a padding row in the scratch page
    assert runner.graphs.captured == (4,)
    assert torch.equal(padded, graphed[:3])  # rows are independent: padding changes nothing
    # Eager runs 3 rows where the graph ran 4: torch may reduce in another order.
    torch.testing.assert_close(padded, runner.forward_eager(three), rtol=1e-4, atol=1e-4)


def test_auto_weights_measure_both_layouts_and_load_the_choice(tiny):
    from engine.layers.ggml_linear import GGMLLinear

    loaded = load_for(tiny, opts("cuda", "auto", True))
    choice = loaded.layout_choice
    assert choice is not None and choice.layout in ("ggml", "q8", "bf16")
    assert {"ggml", "q8"} <= set(choice.forward_ms)
    assert all(ms > 0 for by_rows in choice.forward_ms.values() for ms in by_rows.values())
    qkv = loaded.model.blocks[0].qkv
    assert isinstance(qkv, GGMLLinear) == (choice.layout != "bf16")
    assert getattr(qkv, "act8", False) == (choice.layout == "q8")


def test_hybrid_weights_measure_their_threshold_and_load_it(tiny):
    from engine.layers.ggml_linear import GGMLLinear
    from engine.layout_tune import HYBRID_ROWS

    loaded = load_for(tiny, opts("cuda", "hybrid", True))
    choice = loaded.layout_choice
    assert choice is not None and choice.layout in ("q8", "hybrid")
    assert set(choice.forward_ms) == {"q8", "bf16"}
    assert all(set(by_rows) == set(HYBRID_ROWS) for by_rows in choice.forward_ms.values())
    qkv = loaded.model.blocks[0].qkv
    assert isinstance(qkv, GGMLLinear) and qkv.act8
    assert qkv.dense_rows == choice.dense_rows
    assert (qkv.dense is not None) == (choice.layout == "hybrid")


def test_mixed_graph_captured_when_idle_replays_the_eager_bits(tiny):
    """A mixed step (decode rows beside a chunk) on real CUDA graphs: due at its second
    sighting, it runs eagerly and waits; the idle capture leaves every real K/V slot as it
    was (its runs write the scratch pages only); the replay then gives the eager step's
    logits bit for bit (q8: a row's product has the same bits at any token count). Past
    the graph limit, a capture drops the least recently replayed graph."""
    model = load_for(tiny, opts("cuda", "q8", True)).model
    runner = ModelRunner(model, 48, 16, "f16", cuda_graphs=True, max_context=256)
    assert runner.mixed is not None and runner.mixed.when == "idle"
    seqs = [SeqPages(runner.pool) for _ in range(3)]
    prompts = prompts_for(3)
    runner.forward(span_batch(runner, seqs, list(enumerate(prompts))))  # prefill, eager
    mixed = span_batch(runner, seqs, [(0, [11]), (1, [12]), (2, list(range(100, 120)))])
    eager = runner.forward(mixed)
    assert not runner.last_replayed and runner.num_pending_graphs == 0
    assert torch.equal(runner.forward(mixed), eager)  # due now: still eager, kept
    assert not runner.last_replayed and runner.num_pending_graphs == 1
    real = 48 * 16  # the pool's pages; the scratch page comes after them
    before = [p[:real].clone() for side in (runner.kv.k, runner.kv.v) for layer in side
              for p in layer.values()]
    assert runner.idle() and not runner.idle() and runner.num_pending_graphs == 0
    after = [p[:real] for side in (runner.kv.k, runner.kv.v) for layer in side
             for p in layer.values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    replayed = runner.forward(mixed)
    assert runner.last_replayed and not runner.last_captured
    assert torch.equal(replayed, eager)
    # At the limit, the next due key's capture drops the graph replayed longest ago: the
    # pool's memory goes on serving the graphs held, and the dropped key runs eagerly.
    runner.mixed.max_graphs = 1
    later = span_batch(runner, seqs, [(0, [13]), (1, [14]), (2, list(range(200, 240)))])
    later_eager = runner.forward(later)
    runner.forward(later)
    assert runner.idle() and runner.mixed.num_dropped == 1 and runner.mixed.num_graphs == 1
    assert torch.equal(runner.forward(later), later_eager) and runner.last_replayed
    assert torch.equal(runner.forward(mixed), eager) and not runner.last_replayed


@pytest.mark.parametrize("kv_quant", ["f16", "k8v4"])
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_a_decoding_row_is_bit_equal_alone_and_among_others(tiny, kv_quant, graphs):
    """DESIGN's batch invariance on the device: a row of 300 keys decodes alone (its keys
    in 128-key splits: one row would leave the multiprocessors idle) and then as row 0 of
    16 (where the step's row count once chose 256-key splits), then beside a prompt's
    chunk (a mixed step: its own launch with the decode config): the same logits, bit for
    bit, q8 (a row's product has the same bits at any row count)."""
    model = load_for(tiny, opts("cuda", "q8", graphs)).model
    gen = torch.Generator().manual_seed(11)
    lengths = [300] + torch.randint(20, 400, (15,), generator=gen).tolist()
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in lengths]
    tokens = [[int(t)] for t in torch.randint(3, 200, (3,), generator=gen)]
    chunk = torch.randint(3, 200, (40,), generator=gen).tolist()
    logits = {}
    for name in ("alone", "among"):
        runner = ModelRunner(model, 640, 16, kv_quant, cuda_graphs=graphs, max_context=1024)
        if runner.mixed is not None:
            runner.mixed.capture_at, runner.mixed.when = 1, "step"
        seqs = [SeqPages(runner.pool) for _ in range(17)]
        rows = 1 if name == "alone" else 16
        for i in range(rows):  # each prompt on its own: the same prefill bits
            runner.forward(span_batch(runner, seqs, [(i, prompts[i])]))
        got = []
        for t in tokens[:2]:
            spans = [(0, t)] + [(i, [5 + i]) for i in range(1, rows)]
            got.append(runner.forward(span_batch(runner, seqs, spans))[0])
            assert runner.last_replayed == graphs
        spans = [(0, tokens[2]), (16, chunk)] + ([(3, [9])] if rows > 1 else [])
        got.append(runner.forward(span_batch(runner, seqs, spans))[0])
        assert runner.last_replayed == graphs
        logits[name] = got
    for step, (a, b) in enumerate(zip(logits["alone"], logits["among"], strict=True)):
        assert torch.equal(a, b), (step, float((a - b).abs().max()))
