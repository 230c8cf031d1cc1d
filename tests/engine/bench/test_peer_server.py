"""The llama.cpp peer server (`python -m llama_cpp.server` in a subprocess) and the
fairness scenario on a target that declares itself serial."""

from __future__ import annotations

import asyncio
import importlib.util
import socket

import pytest
from bench_fakes import ScriptedTarget, parse_cli, result, timeline

from appliance.cli import bench_command
from engine.bench.fairness import FairnessSpec, run_fairness
from engine.bench.peer_server import (
    PeerServer,
    PeerServerConfig,
    open_llama_cpp_server,
)
from engine.bench.prompts import PromptFactory
from engine.bench.target import Prompt
from engine.errors import EngineError, InvalidRequest

needs_server = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None
        for m in ("llama_cpp", "fastapi", "sse_starlette", "starlette_context",
                  "pydantic_settings")),
    reason="llama-cpp-python[server] is not installed")

PROMPT = "The lighthouse keeper wrote in the log that the storm"


def _refuses(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) != 0


@needs_server
def test_peer_server_answers_like_llama_cpp_in_process(default_model_path):
    import llama_cpp

    from engine.gguf import ModelFile

    llm = llama_cpp.Llama(str(default_model_path), n_ctx=256, n_threads=1, verbose=False)
    expected = llm.create_completion(PROMPT, max_tokens=8, temperature=0.0,
                                     repeat_penalty=1.0)["choices"][0]["text"]
    llm_ids = llm.tokenize(PROMPT.encode(), add_bos=True, special=True)
    llm.close()

    async def run():
        target = await open_llama_cpp_server(default_model_path, n_ctx=512, n_threads=1)
        server = target.server
        try:
            streamed = await target.complete(Prompt(PROMPT), 8, first_token=asyncio.Event())
            body = await target._body(PROMPT, 8, stream=False)
            resp = await target._client.post(f"{target.base}/v1/completions", json=body)
            counted = await target.count_tokens(PROMPT)
            described = target.describe()
        finally:
            await target.aclose()
        return server, streamed, body, resp.json(), described, target.eog_ids, counted

    server, streamed, body, answer, described, eog_ids, counted = asyncio.run(run())
    assert streamed.completion_tokens == 8 and streamed.finish_reason == "length"
    assert streamed.token_times == sorted(streamed.token_times) and streamed.ttft_s > 0
    assert answer["choices"][0]["text"] == expected  # greedy, no repeat penalty
    assert counted == answer["usage"]["prompt_tokens"] == len(llm_ids)
    # the same prompt twice: llama.cpp reuses all but the last token of the first
    assert described["max_prefix_reuse_tokens"] == len(llm_ids) - 1
    assert body["repeat_penalty"] == 1.0 and body["ignore_eos"] is True
    assert set(body["logit_bias"]) == {str(i) for i in eog_ids}
    assert described["serial"] and described["n_threads"] == 1
    assert server.process is None and not server.log_path.exists()
    assert _refuses(server.config.host, server.port)


    with ModelFile.open(default_model_path) as mf:  # llama.cpp's EOG set holds the file's EOS
        eos = mf.get("tokenizer.ggml.eos_token_id")
        vocab = len(mf.get("tokenizer.ggml.tokens"))
    assert eos in eog_ids and all(0 <= i < vocab for i in eog_ids) and len(eog_ids) < 16


@needs_server
def test_a_server_that_cannot_start_is_reported_and_gone(tmp_path):
    server = PeerServer(PeerServerConfig(str(tmp_path / "missing.gguf"), n_ctx=64,
                                         n_threads=1, startup_timeout_s=60))
    with pytest.raises(EngineError, match="exited"):
        server.start()
    assert server.process is None and not server.log_path.exists()


def test_cli_peer_flag():
    args = parse_cli(["bench", "fairness", "default", "--peer", "llama-cpp-server"])
    assert args.peer == "llama-cpp-server"
    with pytest.raises(InvalidRequest, match="MODEL's file"):
        bench_command._check_source(parse_cli(["bench", "fairness", "--url", "http://x",
                                               "--peer", "llama-cpp-server"]))
    with pytest.raises(SystemExit):
        parse_cli(["bench", "fairness", "default", "--peer", "vllm"])


class DeclaredSerialTarget(ScriptedTarget):
    is_serial = True


def _serial_script() -> dict:
    """One request at a time: stream 1 starts when stream 0 ends (3040 ms), the long prompt
    (sent at 1500 ms) when stream 1 ends (6040 ms), the short one (sent at 1800) after it."""
    warm_times = [(256 + 11 * i) / 1000 for i in range(16)]
    return {
        "warmup": [result(0, [0.05, 0.06]), result(0, warm_times, prompt_tokens=256)],
        "short": [result(0, [0.020, 0.03, 0.04, 0.05]), result(0, [0.030, 0.04, 0.05, 0.06]),
                  result(0, [0.025, 0.03, 0.04, 0.05]),
                  result(1800, [6.700, 6.71, 6.72, 6.73], cached=None)],
        "stream-0": [result(0, timeline(50, 300, lambda t: 10), cached=None)],
        "stream-1": [result(0, timeline(3050, 300, lambda t: 10), cached=None)],
        "long": [result(1500, [6.640], prompt_tokens=2048, cached=None)],
    }


def test_a_declared_serial_target_is_measured():
    target = DeclaredSerialTarget(_serial_script())
    factory = PromptFactory(7, target.tokenizer)
    spec = FairnessSpec(stream_tokens=300, inject_after_s=0.001, short_after_s=0.001)
    out = asyncio.run(run_fairness(target, factory, spec, progress=lambda _m: None))
    assert out["loaded_short_ttft_ms"] == pytest.approx(4900.0)  # queued behind everything
    assert out["fairness_ratio"] == pytest.approx(4900.0 / 25.0, rel=1e-3)
    assert out["long_ttft_ms"] == pytest.approx(5140.0)
    # baseline: stream 0 alone (stream 1 had not started at the injection); no stall after
    assert out["itl_baseline_ms"] == pytest.approx({"mean": 10.0, "p95": 10.0, "max": 10.0})
    assert out["itl_during_injection_ms"]["max"] == pytest.approx(10.0)
    assert out["stream_tokens"] == 300 and len(target.calls["stream-1"]) == 1
    assert out["cache_check"].startswith("unknown")



def test_stream_tokens_are_estimated_without_usage():
    """A server that streams no usage: the warm-up prompt's size comes from the target
    (256 tokens here), not 1. Warm-up TTFT 256 ms, ITL 11 ms: the window is
    0.001 + 0.001 + 2 * 0.256 * 2048 / 256 + 1 + 0.256 = 5.354 s, x1.25 / 0.011 -> 609."""
    script = _serial_script()
    script["warmup"][1].prompt_tokens = None
    target = DeclaredSerialTarget(script)
    spec = FairnessSpec(inject_after_s=0.001, short_after_s=0.001)
    out = asyncio.run(run_fairness(target, PromptFactory(7, target.tokenizer), spec,
                                   progress=lambda _m: None))
    assert out["stream_tokens"] == 609
