"""What a benchmark measures: one `Target` interface, three implementations.

- `InProcessTarget`: an `Engine` in this process (prompts go in as token ids).
- `HttpTarget`: any OpenAI-compatible server (`mbufo serve`, llama.cpp's `llama-server`,
  `python -m llama_cpp.server`, vLLM) through streaming POST /v1/completions.
- `LlamaCppTarget`: llama-cpp-python's `Llama` in this process, one sequence at a time as
  that library runs (requests queue behind each other; their TTFT includes the wait).

Every scenario is written once against `Target`, so mbufo and a peer are measured side by
side in the same run. Every request is greedy (temperature 0) with `ignore_eos`; each
yields a `RequestResult`: the send time and the arrival time of every token event.
Over HTTP a token event is one streamed chunk with text (servers send one token per chunk;
a chunk that carries several still counts once, usage's completion_tokens stays exact).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.bench.target_base import (
    Prompt,
    RequestResult,
    Target,
    common_prefix_len,
    new_request_id,
)
from engine.errors import EngineError, InvalidRequest

# Prompt, RequestResult and Target live in target_base.py; most callers import them here.
__all__ = ["DONE", "HttpTarget", "InProcessTarget", "LlamaCppTarget", "Prompt", "RequestResult",
           "StreamState", "Target", "common_prefix_len", "parse_sse_line"]


class InProcessTarget(Target):
    """An Engine in this process. Token times are taken in the engine's delivery callback,
    i.e. when the loop thread hands the chunk over (no event-loop delay included)."""

    def __init__(self, engine: Any, name: str = "mbufo", options: Any = None,
                 owns_engine: bool = True) -> None:
        self.engine = engine
        self.name = name
        self.options = options
        self.owns_engine = owns_engine
        self.tokenizer = engine.core.tokenizer

    def itl_target_ms(self) -> float | None:
        return self.engine.stats().itl_target_ms

    def slow_steps(self) -> list[dict[str, Any]] | None:
        from dataclasses import asdict

        return [asdict(s) for s in self.engine.stats().slow_steps]

    @classmethod
    def from_model(cls, model: str, options: Any, loaded: Any = None,
                   name: str = "mbufo") -> InProcessTarget:
        from engine.build import build_engine

        return cls(build_engine(model, options, loaded=loaded), name, options)

    async def complete(self, prompt: Prompt, max_tokens: int, *,
                       client: str = "bench",
                       first_token: asyncio.Event | None = None) -> RequestResult:
        from engine.sampler import SamplingParams
        from engine.scheduler.request import Request

        ids = prompt.ids
        if ids is None:
            ids = tuple(self.tokenizer.encode(prompt.text, add_special=True, parse_special=False))
        loop = asyncio.get_running_loop()
        items: asyncio.Queue[tuple[float, Any]] = asyncio.Queue()

        def sink(item: Any) -> None:
            loop.call_soon_threadsafe(items.put_nowait, (time.perf_counter(), item))

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        result = RequestResult(new_request_id("bench"), time.perf_counter())
        self.engine.add(Request(result.request_id, ids, params, client_id=client,
                                arrival=result.sent), sink)
        try:
            while result.finish_reason is None:
                now, item = await items.get()
                if isinstance(item, BaseException):
                    raise item
                result.token_times += [now] * len(item.token_ids)
                if first_token is not None and result.token_times:
                    first_token.set()
                result.prompt_tokens = item.prompt_tokens
                result.cached_tokens = item.cached_tokens
                result.completion_tokens = item.completion_tokens
                result.finish_reason = item.finish_reason
        finally:
            if result.finish_reason is None:
                self.engine.abort(result.request_id)
        return result

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "kind": "in-process", "model": self.engine.name}
        if self.options is not None:
            out["options"] = dataclasses.asdict(self.options)
        return out

    async def aclose(self) -> None:
        if self.owns_engine:
            await asyncio.to_thread(self.engine.stop)


class LlamaCppTarget(Target):
    """llama-cpp-python on the same GGUF file: `Llama.generate` runs one sequence at a time
    (it never stops at EOS on its own, so max_tokens tokens always come out). Its prompt
    cache keeps the previous prompt's KV and reuses the longest common prefix; that prefix
    is reported as cached_tokens."""

    is_serial = True
    cache_slack = 4

    def __init__(self, model_path: str | os.PathLike, *, n_ctx: int, n_threads: int,
                 tokenizer: Any = None, name: str = "llama-cpp") -> None:
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise InvalidRequest("--peer llama-cpp needs llama-cpp-python "
                                 "(pip install llama-cpp-python)") from exc
        self.name = name
        self.tokenizer = tokenizer
        self.n_threads = n_threads
        self.model_path = str(model_path)
        self._llm = Llama(model_path=self.model_path, n_ctx=n_ctx, n_threads=n_threads,
                          n_threads_batch=n_threads, verbose=False)
        self._lock = asyncio.Lock()

    async def complete(self, prompt: Prompt, max_tokens: int, *,
                       client: str = "bench",
                       first_token: asyncio.Event | None = None) -> RequestResult:
        if prompt.ids is not None:
            ids = list(prompt.ids)
        else:
            ids = self._llm.tokenize(prompt.text.encode("utf-8"), add_bos=True, special=False)
        result = RequestResult(new_request_id("llama-cpp"), time.perf_counter())
        loop = asyncio.get_running_loop()
        on_first = (lambda: loop.call_soon_threadsafe(first_token.set)) if first_token else None
        async with self._lock:
            await asyncio.to_thread(self._generate, ids, max_tokens, result, on_first)
        return result

    def _generate(self, ids: list[int], max_tokens: int, result: RequestResult,
                  on_first: Callable[[], Any] | None) -> None:
        llm = self._llm
        # generate() keeps the KV of the longest common prefix of the previous input and
        # `ids` (one token short when the whole prompt matches: it re-evaluates the last).
        previous = llm.input_ids[: llm.n_tokens].tolist()
        result.cached_tokens = min(common_prefix_len(previous, ids), len(ids) - 1)
        result.prompt_tokens = len(ids)
        for _token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                   repeat_penalty=1.0, reset=True):
            result.token_times.append(time.perf_counter())
            if on_first is not None and len(result.token_times) == 1:
                on_first()
            if len(result.token_times) >= max_tokens:
                break
        result.completion_tokens = len(result.token_times)
        result.finish_reason = "length"

    def describe(self) -> dict[str, Any]:
        import llama_cpp

        return {"name": self.name, "kind": "llama-cpp-python", "version": llama_cpp.__version__,
                "model": self.model_path, "n_threads": self.n_threads, "serial": True}


# ---- OpenAI-compatible HTTP ----------------------------------------------------------------
DONE = "[DONE]"


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One line of a text/event-stream: the JSON of a `data:` line, DONE for `data: [DONE]`,
    None for anything else (blank separators, comments, `event:`/`id:` fields)."""
    if not line.startswith("data:"):
        return None
    payload = line[5:].strip()
    if not payload:
        return None
    if payload == DONE:
        return DONE
    try:
        return json.loads(payload)
    except json.JSONDecodeError as exc:
        raise EngineError(f"the server sent an event that is not JSON: {payload[:200]!r}") from exc


@dataclass(slots=True)
class StreamState:
    """Accumulates one streamed completion. Cached prompt tokens are read from, in order:
    OpenAI's usage.prompt_tokens_details.cached_tokens, llama-server's timings.cache_n,
    llama.cpp's native `tokens_cached`; when none is sent the count stays None (unknown)."""

    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    def feed(self, event: dict[str, Any], now: float) -> None:
        if "error" in event:
            raise EngineError(f"the server reported an error: {event['error']}")
        for choice in (event.get("choices") or [])[:1]:
            text = choice.get("text")
            if text is None:  # a chat-completions delta
                text = (choice.get("delta") or {}).get("content")
            if text:
                self.token_times.append(now)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.finish_time = now
        usage = event.get("usage") or {}
        if usage.get("prompt_tokens") is not None:
            self.prompt_tokens = usage["prompt_tokens"]
        if usage.get("completion_tokens") is not None:
            self.completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details") or {}
        timings = event.get("timings") or {}
        for cached in (details.get("cached_tokens"), timings.get("cache_n"),
                       event.get("tokens_cached")):
            if cached is not None:
                self.cached_tokens = cached
                break
        if self.prompt_tokens is None and event.get("tokens_evaluated") is not None:
            self.prompt_tokens = event["tokens_evaluated"]

    def result(self, request_id: str, sent: float) -> RequestResult:
        times = list(self.token_times)
        if not times and self.finish_time is not None:  # the only token came with the end
            times = [self.finish_time]
        completion = self.completion_tokens if self.completion_tokens is not None else len(times)
        return RequestResult(request_id, sent, times, self.prompt_tokens, self.cached_tokens,
                             completion, self.finish_reason)


class HttpTarget(Target):
    """An OpenAI-compatible server at `url` (with or without the trailing /v1).

    Measured against `python -m llama_cpp.server` 0.3.36: it streams no usage (counts are
    then asked for separately, the cache is reported unknown), ignores `ignore_eos`, and
    by default a new request interrupts the running one, so it serves one request at a
    time; llama.cpp's own `llama-server --parallel N` decodes N concurrently."""

    cache_slack = 4

    def __init__(self, url: str, *, model: str | None = None, api_key: str | None = None,
                 name: str = "http", client: Any = None) -> None:
        import httpx

        base = url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        self.name = name
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(30.0, read=600.0), headers=headers,  # long prefills
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        self._model_known = model is not None

    async def _model_name(self) -> str | None:
        if not self._model_known:  # vLLM needs `model`; llama.cpp accepts any
            self._model_known = True
            try:
                resp = await self._client.get(f"{self.base}/v1/models")
                self.model = resp.json()["data"][0]["id"]
            except Exception:  # a server without /v1/models: send no model name
                self.model = None
        return self.model

    async def _body(self, text: str, max_tokens: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": text, "max_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        model = await self._model_name()
        if model is not None:
            body["model"] = model
        return body

    async def complete(self, prompt: Prompt, max_tokens: int, *,
                       client: str = "bench",
                       first_token: asyncio.Event | None = None) -> RequestResult:
        body = await self._body(prompt.text, max_tokens, stream=True)
        state = StreamState()
        sent = time.perf_counter()
        url = f"{self.base}/v1/completions"
        async with self._client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode("utf-8", "replace")[:300]
                raise EngineError(f"{url} answered {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                now = time.perf_counter()
                event = parse_sse_line(line)
                if event == DONE:
                    break
                if isinstance(event, dict):
                    state.feed(event, now)
                    if first_token is not None and (state.token_times or state.finish_time):
                        first_token.set()
        return state.result(new_request_id("http"), sent)

    async def count_tokens(self, text: str) -> int:
        """The server's own count: usage.prompt_tokens of a 1-token, non-streamed request."""
        resp = await self._client.post(f"{self.base}/v1/completions",
                                       json=await self._body(text, 1, stream=False))
        if resp.status_code != 200:
            raise EngineError(f"{self.base} answered {resp.status_code}: {resp.text[:300]}")
        tokens = (resp.json().get("usage") or {}).get("prompt_tokens")
        if tokens is None:
            raise EngineError(f"{self.base} reports no usage.prompt_tokens: cannot size prompts")
        return int(tokens)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": "http", "url": self.base, "model": self.model}

    async def aclose(self) -> None:
        await self._client.aclose()
