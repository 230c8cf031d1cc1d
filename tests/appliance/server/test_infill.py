"""Fill-in-the-middle through /v1/completions' `suffix`.

The prompt the server builds is checked against llama.cpp: a tiny model on the
DeepSeek-Coder vocabulary (it has FIM tokens) must answer what the engine's one-sequence
path (engine.llm.LLM) greedily writes after [BOS] FIM_PRE prefix FIM_SUF suffix FIM_MID,
with the FIM ids and the two texts' tokens taken from llama.cpp's own vocabulary calls.
"""

from __future__ import annotations

import sys
from pathlib import Path

import llama_cpp
import openai
import pytest
from server_harness import TINY_SPEC, assert_openai_error, start_harness

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.synthetic import write_synthetic_gguf

sys.path.insert(0, str(Path(__file__).parents[2] / "engine" / "tokenizer"))
from tokenizer_reference import LlamaVocabRef  # noqa: E402

pytestmark = pytest.mark.anyio
PREFIX = "def add(a, b):\n    return "
SUFFIX = "\n\nprint(add(1, 2))  # <｜fim▁hole｜> stays text\n"


@pytest.fixture(scope="module")
def coder_gguf(tmp_path_factory, vocab_dir):
    path = tmp_path_factory.mktemp("models") / "coder.gguf"
    write_synthetic_gguf(path, TINY_SPEC, vocab_dir / "ggml-vocab-deepseek-coder.gguf", seed=3)
    return path


@pytest.fixture(scope="module")
async def harness(tmp_path_factory, coder_gguf, tiny_gguf):
    h = await start_harness(tmp_path_factory.mktemp("infill"), [str(coder_gguf), str(tiny_gguf)],
                            dtype="f32")
    yield h
    await h.close()


async def test_suffix_builds_llama_cpps_infill_prompt(harness, coder_gguf):
    ref = LlamaVocabRef(coder_gguf)
    fim = {k: getattr(llama_cpp, f"llama_vocab_fim_{k}")(ref.vocab) for k in ("pre", "suf", "mid")}
    ids = ([ref.bos()] if ref.add_bos() else []) + [fim["pre"]] + \
        ref.tokenize(PREFIX, False, False) + [fim["suf"]] + ref.tokenize(SUFFIX, False, False) + \
        [fim["mid"]]
    steps = list(LLM(coder_gguf, dtype="f32", context=256).generate(
        ids, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))
    client = harness.openai()
    resp = await client.completions.create(model="coder", prompt=PREFIX, suffix=SUFFIX,
                                           max_tokens=8, temperature=0, extra_body={
                                               "ignore_eos": True})
    assert resp.choices[0].text == "".join(s.text for s in steps)
    assert resp.usage.prompt_tokens == len(ids)
    two = await client.completions.create(model="coder", prompt=[PREFIX, "x = "], suffix=SUFFIX,
                                          max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert two.choices[0].text == resp.choices[0].text and len(two.choices) == 2


async def test_suffix_errors(harness):
    client = harness.openai()
    with pytest.raises(openai.BadRequestError) as exc:  # the SPM test vocabulary has no FIM
        await client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX)
    assert exc.value.body["param"] == "suffix" and "fill-in-the-middle" in exc.value.body["message"]
    resp = await harness.http.post("/v1/completions", headers=harness.auth(), json={
        "model": "coder", "prompt": [1, 2, 3], "suffix": SUFFIX})
    assert assert_openai_error(resp, 400)["param"] == "prompt"
