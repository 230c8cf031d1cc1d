"""Embeddings (engine/embed.py) against llama.cpp's: a tiny qwen3 file (Qwen3-Embedding's
family) that pools the last token, and a llama one that pools the mean, written with
`<arch>.pooling_type`; llama-cpp-python embeds the same texts (its own tokens, which ours
must equal) from the same files."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from engine.build import EngineOptions, build_engine
from engine.errors import EngineError, InvalidRequest
from engine.synthetic import SyntheticSpec, write_synthetic_gguf

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 9, "x"]
CASES = {"last": ("qwen3", "ggml-vocab-qwen2.gguf", 3),
         "mean": ("llama", "ggml-vocab-llama-spm.gguf", 1)}


@pytest.fixture(scope="module", params=sorted(CASES))
def embed_file(request, tmp_path_factory, vocab_dir):
    arch, vocab, pooling = CASES[request.param]
    path = tmp_path_factory.mktemp("embed") / f"{arch}.gguf"
    write_synthetic_gguf(path, SyntheticSpec(arch, context_length=512, pooling_type=pooling,
                                             default_type=0), vocab_dir / vocab, seed=4)
    return request.param, path


def test_pooled_states_match_llama_cpp(embed_file):
    import llama_cpp  # the reference (not on the GPU machine, where only the gpu test runs)

    pooling, path = embed_file
    logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
    ref = llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=512, n_batch=512,
                          verbose=False)
    engine = build_engine(path, EngineOptions(dtype="f32", sessions=2, context=512,
                                              prefill_chunk=64))
    assert engine.loaded.config.pooling == pooling
    from engine.inspect import inspect_model

    assert inspect_model(path)["pooling"] == pooling
    tok = engine.loaded.tokenizer
    ids = [tok.encode(t, add_special=True, parse_special=False) for t in TEXTS]
    assert ids == [ref.tokenize(t.encode()) for t in TEXTS]
    assert len(ids[1]) > 64  # more than one prefill chunk
    try:
        ours = asyncio.run(engine.embed(ids))
    finally:
        engine.stop()
    with pytest.raises(EngineError, match="not running"):  # a stopped engine answers at once
        asyncio.run(engine.embed(ids))
    for got, text in zip(ours, TEXTS, strict=True):
        want = torch.tensor(ref.embed(text), dtype=torch.float64)
        assert got.shape == want.shape
        cos = torch.nn.functional.cosine_similarity(got.double(), want, dim=0)
        assert cos > 0.9999, (text[:20], float(cos))
        assert torch.allclose(got.double(), want, rtol=1e-3, atol=1e-3 * want.abs().max())
    assert engine.core.pool.groups and all(
        p.num_free == p.num_pages for p in engine.core.pool.groups.values())  # pages back


def test_a_generator_has_no_embeddings(tmp_path, vocab_dir):
    path = tmp_path / "gen.gguf"
    write_synthetic_gguf(path, SyntheticSpec("llama", context_length=256),
                         vocab_dir / "ggml-vocab-llama-spm.gguf")
    engine = build_engine(path, EngineOptions(dtype="f32", sessions=1, context=256))
    try:
        with pytest.raises(InvalidRequest, match="not an embedding model"):
            asyncio.run(engine.embed([[1, 2]]))
    finally:
        engine.stop()


def test_a_long_input_lets_the_streams_step_between_its_chunks(embed_file):
    """A 5-chunk input beside a decoding stream: the engine takes a generation step
    between every two of its chunks, and both finish."""
    from engine.sampling_params import SamplingParams
    from engine.scheduler.request import Request

    _, path = embed_file
    engine = build_engine(path, EngineOptions(dtype="f32", sessions=2, context=512,
                                              prefill_chunk=64))
    steps_at: list[int] = []
    hidden = engine.core.runner.hidden_states

    def counting(batch):
        steps_at.append(engine.core.num_steps)
        return hidden(batch)

    engine.core.runner.hidden_states = counting

    async def both():
        async def stream():
            params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
            return [c async for c in engine.submit(Request("gen", (1, 2, 3), params))]

        gen = asyncio.create_task(stream())
        await asyncio.sleep(0.05)  # the stream is decoding
        vectors = await engine.embed([list(range(5, 305))])
        return await gen, vectors

    try:
        chunks, vectors = asyncio.run(both())
    finally:
        engine.stop()
    assert len(steps_at) == 5 and len(vectors) == 1
    assert all(b > a for a, b in zip(steps_at, steps_at[1:], strict=False)), steps_at
    assert sum(len(c.token_ids) for c in chunks) == 400


@pytest.mark.gpu
def test_the_device_pools_what_the_cpu_pools(embed_file):
    """The Triton path's states (every weight layout the GPU picks) against the CPU's."""
    _, path = embed_file
    ids = [list(range(5, 305)), [7, 8, 9]]
    vectors = {}
    for device in ("cpu", "cuda"):
        engine = build_engine(path, EngineOptions(dtype="f32" if device == "cpu" else "auto",
                                                  device=device, sessions=2, context=512,
                                                  prefill_chunk=64))
        try:
            vectors[device] = asyncio.run(engine.embed(ids))
        finally:
            engine.stop()
    for cpu, gpu in zip(vectors["cpu"], vectors["cuda"], strict=True):
        cos = torch.nn.functional.cosine_similarity(cpu.double(), gpu.double(), dim=0)
        assert cos > 0.999, float(cos)


def test_clients_take_turns_input_by_input():
    from engine.embed import EmbedJob, next_job

    def job(client, running=False):
        j = EmbedJob([[1]], lambda out: None, client)
        j.run = object() if running else None
        return j

    jobs = [job("a"), job("a"), job("b"), job("c")]
    assert [next_job(jobs, last) for last in (None, "a", "b", "c", "gone")] == [0, 2, 3, 0, 0]
    jobs[1].run = object()  # an input under way finishes first
    assert next_job(jobs, "a") == 1


def test_a_clients_one_query_passes_anothers_many_documents(embed_file):
    """Client a's 6 inputs, then client b's 1: b's vector comes back after at most one of
    a's inputs more (the loop takes the clients' inputs in turn), a's all arrive too."""
    _, path = embed_file
    engine = build_engine(path, EngineOptions(dtype="f32", sessions=2, context=512,
                                              prefill_chunk=64))
    order: list[str] = []

    async def both():
        async def run(client, inputs):
            out = await engine.embed(inputs, client)
            order.append(client)
            return out

        many = asyncio.create_task(run("a", [list(range(5, 200))] * 6))
        await asyncio.sleep(0)  # a's job is posted first
        one = asyncio.create_task(run("b", [[7, 8, 9]]))
        return await many, await one

    try:
        many, one = asyncio.run(both())
    finally:
        engine.stop()
    assert order == ["b", "a"] and len(many) == 6 and len(one) == 1
    assert all(torch.equal(v, many[0]) for v in many)  # the same input, the same bits
