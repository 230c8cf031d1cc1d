"""/v1/embeddings through the official `openai` client, against llama.cpp: a tiny qwen3
embedding file (it pools the last token, as Qwen3-Embedding does) embedded by
llama-cpp-python from the same file, normalized as OpenAI's vectors are."""

from __future__ import annotations

import base64
import logging

import llama_cpp
import numpy as np
import openai
import pytest
from server_harness import assert_openai_error, start_harness

from engine.synthetic import SyntheticSpec, write_synthetic_gguf

pytestmark = pytest.mark.anyio
TEXTS = ["Hello world", "Embeddings for a household's documents. " * 6]


@pytest.fixture(scope="module")
def embed_gguf(tmp_path_factory, vocab_dir):
    path = tmp_path_factory.mktemp("models") / "embed.gguf"
    write_synthetic_gguf(path, SyntheticSpec("qwen3", context_length=256, pooling_type=3,
                                             default_type=0),
                         vocab_dir / "ggml-vocab-qwen2.gguf", seed=8)
    return path


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, embed_gguf, tiny_gguf):
    h = await start_harness(tmp_path_factory.mktemp("embeddings"),
                            [str(embed_gguf), str(tiny_gguf)], dtype="f32")
    yield h
    await h.close()


@pytest.fixture(scope="module")
def reference(embed_gguf):
    logging.getLogger("llama-cpp-python").setLevel(logging.CRITICAL)
    return llama_cpp.Llama(model_path=str(embed_gguf), embedding=True, n_ctx=256, n_batch=256,
                           verbose=False)


async def test_embeddings_match_llama_cpp(harness, reference):
    client = harness.openai()
    resp = await client.embeddings.create(model="embed", input=TEXTS)
    assert [d.index for d in resp.data] == [0, 1] and resp.model == "embed"
    tokens = [reference.tokenize(t.encode()) for t in TEXTS]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(map(len, tokens))
    for got, text in zip(resp.data, TEXTS, strict=True):
        want = np.asarray(reference.embed(text, normalize=True), dtype=np.float64)
        vec = np.asarray(got.embedding, dtype=np.float64)
        assert vec.shape == want.shape and abs(np.linalg.norm(vec) - 1) < 1e-5
        assert float(vec @ want) > 0.9999
    # token ids embed as their text does; base64 holds the same floats
    by_ids = await client.embeddings.create(model="embed", input=tokens[0])
    assert np.allclose(by_ids.data[0].embedding, resp.data[0].embedding, atol=1e-6)
    raw = await harness.http.post("/v1/embeddings", headers=harness.auth(), json={
        "model": "embed", "input": TEXTS[0], "encoding_format": "base64"})
    floats = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), "<f4")
    assert np.allclose(floats, resp.data[0].embedding, atol=0)
    # Matryoshka: the first components, at unit length again
    short = await client.embeddings.create(model="embed", input=TEXTS[0], dimensions=16)
    full = np.asarray(resp.data[0].embedding)
    assert np.allclose(short.data[0].embedding, full[:16] / np.linalg.norm(full[:16]),
                       atol=1e-6)
    metrics = (await harness.http.get("/metrics")).text
    assert 'mbufo:request_success_total{finished_reason="embedding",' in metrics


async def test_embedding_errors(harness):
    client = harness.openai()
    with pytest.raises(openai.BadRequestError) as exc:  # a generator, not an embedder
        await client.embeddings.create(model="tiny", input="x")
    assert exc.value.body["code"] == "model_not_supported"
    for bad in ({"input": ""}, {"input": []}, {"input": [[1], "a"]}, {"input": [10**9]},
                {"input": "x", "dimensions": 10**4}, {"input": "word " * 300},
                {"input": "x", "encoding_format": "int8"}):
        resp = await harness.http.post("/v1/embeddings", headers=harness.auth(),
                                       json={"model": "embed", **bad})
        assert_openai_error(resp, 400), bad
