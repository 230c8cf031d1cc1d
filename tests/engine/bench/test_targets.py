"""SSE parsing of recorded server streams, HttpTarget over a mock transport, and
InProcessTarget over a fake engine."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from bench_fakes import WordTokenizer

from engine.bench.target import (
    DONE,
    HttpTarget,
    InProcessTarget,
    Prompt,
    StreamState,
    parse_sse_line,
)
from engine.errors import EngineError
from engine.scheduler.request import OutputChunk

# llama.cpp's llama-server, POST /v1/completions with stream=true: one chunk per token, the
# final chunk has empty text, usage and `timings` (cache_n = prompt tokens reused).
LLAMA_SERVER = """\
data: {"choices":[{"text":" the","index":0,"logprobs":null,"finish_reason":null}],"created":1736000000,"model":"gpt-3.5-turbo","system_fingerprint":"b4600-1a2b3c4d","object":"text_completion","id":"chatcmpl-q1"}

data: {"choices":[{"text":" cat","index":0,"logprobs":null,"finish_reason":null}],"created":1736000000,"model":"gpt-3.5-turbo","system_fingerprint":"b4600-1a2b3c4d","object":"text_completion","id":"chatcmpl-q1"}

data: {"choices":[{"text":" sat","index":0,"logprobs":null,"finish_reason":null}],"created":1736000000,"model":"gpt-3.5-turbo","system_fingerprint":"b4600-1a2b3c4d","object":"text_completion","id":"chatcmpl-q1"}

data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"created":1736000000,"model":"gpt-3.5-turbo","system_fingerprint":"b4600-1a2b3c4d","object":"text_completion","usage":{"completion_tokens":3,"prompt_tokens":45,"total_tokens":48},"id":"chatcmpl-q1","timings":{"cache_n":1,"prompt_n":44,"prompt_ms":120.5,"prompt_per_token_ms":2.74,"prompt_per_second":365.1,"predicted_n":3,"predicted_ms":45.3,"predicted_per_token_ms":15.1,"predicted_per_second":66.2}}

data: [DONE]

"""  # noqa: E501 (recorded streams, verbatim)

# OpenAI / vLLM with stream_options.include_usage: usage null on every chunk, then a last
# chunk with no choices and the usage (cached prompt tokens in prompt_tokens_details).
OPENAI = """\
data: {"id":"cmpl-7","object":"text_completion","created":1736000001,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}

: keep-alive comment

data: {"id":"cmpl-7","object":"text_completion","created":1736000001,"model":"m","choices":[{"index":0,"text":" b","logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}

data: {"id":"cmpl-7","object":"text_completion","created":1736000001,"model":"m","choices":[{"index":0,"text":" c","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":null}

data: {"id":"cmpl-7","object":"text_completion","created":1736000001,"model":"m","choices":[],"usage":{"prompt_tokens":40,"total_tokens":43,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}

data: [DONE]

"""  # noqa: E501 (recorded streams, verbatim)

# llama-cpp-python's server: no usage in streams, so the cache is unknown.
LLAMA_CPP_PYTHON = """\
data: {"id":"cmpl-x","object":"text_completion","created":1736000002,"model":"/m.gguf","choices":[{"text":" one","index":0,"logprobs":null,"finish_reason":null}]}

data: {"id":"cmpl-x","object":"text_completion","created":1736000002,"model":"/m.gguf","choices":[{"text":" two","index":0,"logprobs":null,"finish_reason":null}]}

data: {"id":"cmpl-x","object":"text_completion","created":1736000002,"model":"/m.gguf","choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}]}

data: [DONE]

"""  # noqa: E501 (recorded streams, verbatim)

# llama-server with --verbose-style native fields beside the OpenAI ones (tokens_cached).
LLAMA_NATIVE = """\
event: message
data: {"choices":[{"text":"","index":0,"logprobs":null,"finish_reason":"length"}],"object":"text_completion","tokens_cached":7,"tokens_evaluated":30}

"""  # noqa: E501


def _replay(stream: str) -> StreamState:
    state = StreamState()
    for n, line in enumerate(stream.splitlines()):
        event = parse_sse_line(line)
        if event == DONE:
            break
        if isinstance(event, dict):
            state.feed(event, now=float(n))
    return state


def test_llama_server_stream():
    res = _replay(LLAMA_SERVER).result("r", sent=-1.0)
    assert res.token_times == [0.0, 2.0, 4.0]  # the line numbers of the three text chunks
    assert (res.prompt_tokens, res.cached_tokens, res.completion_tokens) == (45, 1, 3)
    assert res.finish_reason == "length"
    assert res.ttft_s == 1.0 and res.itls_s() == [2.0, 2.0]


def test_openai_stream_with_usage():
    res = _replay(OPENAI).result("r", sent=0.0)
    assert res.token_times == [0.0, 4.0, 6.0]
    assert (res.prompt_tokens, res.cached_tokens, res.completion_tokens) == (40, 32, 3)


def test_stream_without_usage_leaves_counts_unknown():
    res = _replay(LLAMA_CPP_PYTHON).result("r", sent=0.0)
    assert res.prompt_tokens is None and res.cached_tokens is None
    assert res.completion_tokens == 2 and res.finish_reason == "length"


def test_native_fields_and_a_token_that_only_came_with_the_end():
    res = _replay(LLAMA_NATIVE).result("r", sent=0.0)
    assert (res.prompt_tokens, res.cached_tokens) == (30, 7)
    assert res.token_times == [1.0]  # the finish chunk stands in for the first token


def test_sse_lines():
    assert parse_sse_line("") is None and parse_sse_line(": ping") is None
    assert parse_sse_line("event: completion") is None
    assert parse_sse_line("data: [DONE]") == DONE
    assert parse_sse_line('data:{"a":1}') == {"a": 1}
    with pytest.raises(EngineError, match="not JSON"):
        parse_sse_line("data: {oops")
    with pytest.raises(EngineError, match="server reported an error"):
        StreamState().feed({"error": {"message": "context full"}}, 0.0)


def test_http_target_over_a_mock_transport():
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "served"}]})
        body = json.loads(request.content)
        bodies.append(body)
        if not body["stream"]:
            return httpx.Response(200, json={"choices": [{"text": "x"}],
                                             "usage": {"prompt_tokens": 412}})
        return httpx.Response(200, content=LLAMA_SERVER.encode(),
                              headers={"content-type": "text/event-stream"})

    async def run():
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        target = HttpTarget("http://server:8080/v1/", client=client)
        started = asyncio.Event()
        res = await target.complete(Prompt("hello there"), 3, first_token=started)
        assert started.is_set()
        count = await target.count_tokens("four hundred words")
        await target.aclose()
        return target, res, count

    target, res, count = asyncio.run(run())
    assert target.base == "http://server:8080" and count == 412
    assert len(res.token_times) == 3 and res.cached_tokens == 1 and res.prompt_tokens == 45
    assert res.token_times == sorted(res.token_times) and res.sent <= res.token_times[0]
    stream = bodies[0]
    assert stream == {"prompt": "hello there", "max_tokens": 3, "temperature": 0,
                      "ignore_eos": True, "stream": True, "model": "served",
                      "stream_options": {"include_usage": True}}
    assert bodies[1]["stream"] is False and bodies[1]["max_tokens"] == 1


class FakeEngine:
    """Delivers two chunks (2 tokens, then 1 with the finish) from another thread."""

    name = "fake"

    def __init__(self):
        self.core = type("Core", (), {"tokenizer": WordTokenizer()})()
        self.requests, self.aborted = [], []

    def add(self, request, sink):
        self.requests.append(request)

        def deliver():
            sink(OutputChunk(request.id, (5, 6), "ab", None, None, 9, 0, 2))
            sink(OutputChunk(request.id, (7,), "c", None, "length", 9, 0, 3))

        threading.Thread(target=deliver).start()

    def abort(self, request_id):
        self.aborted.append(request_id)


def test_in_process_target_records_each_token():
    engine = FakeEngine()
    target = InProcessTarget(engine, owns_engine=False)

    async def run():
        started = asyncio.Event()
        res = await target.complete(Prompt("word list here"), 3, client="stream-0",
                                    first_token=started)
        return res, started.is_set()

    res, started = asyncio.run(run())
    assert started
    (request,) = engine.requests
    assert request.prompt_ids == tuple(WordTokenizer().encode("word list here"))
    assert request.client_id == "stream-0"
    assert request.sampling.temperature == 0.0 and request.sampling.ignore_eos
    assert request.sampling.max_tokens == 3
    assert len(res.token_times) == 3 and res.token_times[0] == res.token_times[1]
    assert (res.prompt_tokens, res.cached_tokens, res.completion_tokens) == (9, 0, 3)
    assert res.finish_reason == "length" and engine.aborted == []


def test_llama_cpp_target_on_the_default_model(default_model_path):
    from engine.bench.target import LlamaCppTarget

    target = LlamaCppTarget(default_model_path, n_ctx=256, n_threads=2)

    async def run():
        started = asyncio.Event()
        first = await target.complete(Prompt("The lighthouse keeper wrote in the log"), 5,
                                      first_token=started)
        ids = target._llm.tokenize(b"The lighthouse keeper wrote in the log", add_bos=True,
                                   special=False)
        # shares the first 4 tokens with the previous prompt: llama.cpp reuses them
        second = await target.complete(Prompt("", tuple(ids[:4]) + (1000, 2000, 3000)), 3)
        return first, second, started.is_set(), ids

    first, second, started, ids = asyncio.run(run())
    assert started and len(first.token_times) == 5 and first.completion_tokens == 5
    assert first.prompt_tokens == len(ids) and first.finish_reason == "length"
    assert first.token_times == sorted(first.token_times) and first.ttft_s > 0
    assert second.prompt_tokens == 7 and second.cached_tokens == 4
    assert target.describe()["serial"] is True
