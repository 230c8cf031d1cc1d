"""Running one generation job: admission per key, the engine requests, accounting.

A job is one HTTP request: n choices (x prompts, for a batched text completion), each an
engine Request whose client id is the API key id, so the scheduler rotates fairly over
keys and applies the key's pending limit. Admission order: shutting down / model gone
(503), the model's in-flight cap (503), the key's concurrent-request cap (429), the
rate limiter (429). Then every choice is submitted and the first chunk of each awaited
before a status line is sent, so a rejection (client_quota, context) is a real HTTP error.
Whatever happens afterwards, `finish` runs exactly once: it aborts what still runs,
releases the caps and records usage and metrics.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
from litestar import Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from appliance.server.errors import (
    ApiError,
    TooManyRequests,
    Unavailable,
    as_api_error,
    error_body,
)
from appliance.server.services.streams import (
    ChoiceStreams,
    ClientDisconnected,
    until_disconnect,
)
from engine.scheduler.request import OutputChunk, Request

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    request: Request
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_events: int = 0
    prompt_logprobs: tuple | None = None  # the prompt's, from the first chunk (echo)
    reply: Any = None  # the chat reply's parser (replies.py), made at its first chunk
    num_tool_calls: int = 0  # streamed so far


@dataclass(slots=True)
class Job:
    kind: str  # "chat" | "text"
    id: str
    handle: Any  # router.ModelHandle
    principal: Any  # appliance.auth.Principal
    choices: list[Choice]
    prompts: list[tuple[int, ...]]
    estimated_tokens: int
    logprobs: int | None = None  # top entries per token; None: no logprobs
    echo: list[str] | None = None  # per prompt (text completions)
    include_usage: bool = False
    is_prompt_only: bool = False  # echo + logprobs at max_tokens 0: no sampled token shown
    reply_parser: Callable[[], Any] | None = None  # chat: splits reasoning and tool calls
    created: int = field(default_factory=lambda: int(time.time()))
    start: float = field(default_factory=time.perf_counter)
    is_finished: bool = False

    @property
    def model(self) -> str:
        return self.handle.name

    def usage(self) -> dict[str, Any]:
        firsts = {c.prompt_index: c for c in reversed(self.choices)}  # first choice per prompt
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(c.completion_tokens for c in self.choices)
        cached = sum(c.cached_tokens for c in firsts.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class Format:
    """Shapes a job's chunks into OpenAI JSON (services/formats.py implements it). `event`
    returns None where a chunk settles nothing to send (a chat reply's held-back markup)."""

    def event(self, job: Job, choice: Choice, chunk: OutputChunk) -> dict[str, Any] | None: ...
    def usage_event(self, job: Job) -> dict[str, Any]: ...
    def response(self, job: Job) -> dict[str, Any]: ...


def sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class GenerationService:
    def __init__(self, router: Any, limiter: Any, metrics: Any) -> None:
        self.router = router
        self.limiter = limiter
        self.metrics = metrics
        self.is_draining = False
        self.num_jobs = 0
        self._per_key: dict[str, int] = defaultdict(int)

    # -- admission -----------------------------------------------------------------------
    def admit(self, job: Job) -> None:
        handle, principal = job.handle, job.principal
        self.check_serving(handle)
        if handle.num_in_flight >= self.router.max_in_flight:
            raise Unavailable(f"the model '{handle.name}' is overloaded "
                              f"({handle.num_in_flight} requests in flight)",
                              code="overloaded", retry_after_s=1.0)
        self.check_key_cap(principal)
        self.limiter.check_request(principal, job.estimated_tokens)
        max_pending = principal.quota.max_pending
        if handle.client_quotas.get(principal.key_id, -1) != max_pending:
            handle.engine.core.set_client_quota(principal.key_id, max_pending)
            handle.client_quotas[principal.key_id] = max_pending
        self.hold_key(principal.key_id)
        handle.num_in_flight += 1
        self.num_jobs += 1

    def check_serving(self, handle: Any) -> None:
        """503 while the server shuts down or the model is being unloaded."""
        if self.is_draining:
            raise Unavailable("the server is shutting down", code="shutting_down")
        if handle.is_unloading:
            raise Unavailable(f"the model '{handle.name}' is being unloaded",
                              code="model_unloading")

    def check_key_cap(self, principal: Any) -> None:
        """429 when the key already runs its max_concurrent_streams requests (completions
        and embeddings alike)."""
        cap = principal.quota.max_concurrent_streams
        if cap is not None and self._per_key[principal.key_id] >= cap:
            raise TooManyRequests(f"API key {principal.key_id} already has {cap} requests "
                                  f"running (its max_concurrent_streams)",
                                  code="concurrent_streams", retry_after_s=1.0)

    def hold_key(self, key_id: str) -> None:
        self._per_key[key_id] += 1

    def release_key(self, key_id: str) -> None:
        self._per_key[key_id] -= 1
        if self._per_key[key_id] <= 0:
            del self._per_key[key_id]

    # -- running -------------------------------------------------------------------------
    async def run(self, job: Job, fmt: Format, receive: Any, stream: bool) -> Response:
        self.admit(job)
        streams = ChoiceStreams(job.handle.engine, [c.request for c in job.choices])
        for c in job.choices:
            self.metrics.queue.add(c.request.id, job.handle, job.principal.key_id)
        try:
            await until_disconnect(receive, streams.prime())
            if not stream:
                await until_disconnect(receive, self._collect(job, streams))
        except BaseException as exc:
            gone = isinstance(exc, ClientDisconnected) or not isinstance(exc, Exception)
            self.finish(job, streams, "abort" if gone else "error")
            raise
        if not stream:
            self.finish(job, streams, "ok")
            return Response(msgspec.json.encode(fmt.response(job)),
                            media_type="application/json")
        events = self._events(job, fmt, streams)
        return Stream(events, media_type="text/event-stream", headers=SSE_HEADERS,
                      background=BackgroundTask(self._after_stream, job, streams, events))

    async def _after_stream(self, job: Job, streams: ChoiceStreams, events: Any) -> None:
        """After the response (sent, or cut by a disconnect): close the event generator
        where a cancellation left it suspended; `finish` even if it never started."""
        try:
            await events.aclose()
        finally:
            self.finish(job, streams, "abort")

    async def _collect(self, job: Job, streams: ChoiceStreams) -> None:
        async for index, chunk in streams:
            self._feed(job, job.choices[index], chunk)

    async def _events(self, job: Job, fmt: Format,
                      streams: ChoiceStreams) -> AsyncIterator[bytes]:
        status = "abort"
        try:
            async for index, chunk in streams:
                choice = job.choices[index]
                chunk = self._feed(job, choice, chunk)
                if (event := fmt.event(job, choice, chunk)) is not None:
                    yield sse(event)
                    choice.num_events += 1
            if job.include_usage:
                yield sse(fmt.usage_event(job))
            yield DONE
            status = "ok"
        except Exception as exc:  # an engine error or abort mid-stream: tell the client
            status = "error"
            err = as_api_error(exc)
            log.info("stream %s ended with %s: %s", job.id, err.code, err.message)
            yield sse(error_body(err))
            yield DONE
        finally:
            self.finish(job, streams, status)

    def _feed(self, job: Job, choice: Choice, chunk: OutputChunk) -> OutputChunk:
        """Record the chunk on its choice; returns it as the answer shows it."""
        if chunk.finish_reason == "abort":
            raise self._aborted(job)
        if job.is_prompt_only:  # the token sampled after the prompt is not part of it
            chunk = replace(chunk, token_ids=(), text="", logprobs=(), completion_tokens=0)
        now = time.perf_counter()
        num = len(chunk.token_ids)
        labels = (job.model, job.principal.key_id)
        if num:
            if choice.last_token_at is None:
                choice.first_token_at = now
                self.metrics.ttft.labels(*labels).observe(now - job.start)
                self.metrics.queue.first_token(choice.request.id)
            else:
                gap = (now - choice.last_token_at) / num
                for _ in range(num):
                    self.metrics.itl.labels(*labels).observe(gap)
            choice.last_token_at = now
        choice.text.append(chunk.text)
        choice.token_ids += chunk.token_ids
        if job.logprobs is not None and chunk.logprobs is not None:
            choice.logprobs += chunk.logprobs
        choice.prompt_tokens = chunk.prompt_tokens
        choice.cached_tokens = chunk.cached_tokens
        choice.completion_tokens = chunk.completion_tokens
        choice.finish_reason = chunk.finish_reason
        if chunk.prompt_logprobs is not None:
            choice.prompt_logprobs = chunk.prompt_logprobs
        return chunk

    def _aborted(self, job: Job) -> ApiError:
        if self.is_draining:
            return Unavailable("the server is shutting down; the request was stopped",
                               code="shutting_down")
        if job.handle.is_unloading:
            return Unavailable(f"the model '{job.model}' was unloaded while the request ran",
                               code="model_unloaded")
        return Unavailable("the request was aborted", code="aborted")

    def finish(self, job: Job, streams: ChoiceStreams, status: str) -> None:
        """Once per job: abort what runs, release the caps, record usage and metrics."""
        if job.is_finished:
            return
        job.is_finished = True
        streams.close()
        key, handle = job.principal.key_id, job.handle
        self.release_key(key)
        handle.num_in_flight -= 1
        self.num_jobs -= 1
        usage = job.usage()
        self._account(job, usage, status)
        try:
            self.limiter.record(job.principal, job.model, usage["prompt_tokens"],
                                usage["completion_tokens"],
                                usage["prompt_tokens_details"]["cached_tokens"], status)
        except Exception:  # accounting must never turn a finished answer into a 500
            log.exception("could not record usage of %s", job.id)

    def _account(self, job: Job, usage: dict[str, Any], status: str) -> None:
        m, labels = self.metrics, (job.model, job.principal.key_id)
        for c in job.choices:
            m.queue.discard(c.request.id)
        if any(c.completion_tokens for c in job.choices):
            m.e2e.labels(*labels).observe(time.perf_counter() - job.start)
        m.prompt_tokens.labels(*labels).inc(usage["prompt_tokens"])
        m.generation_tokens.labels(*labels).inc(usage["completion_tokens"])
        m.prefix_queries.labels(*labels).inc(usage["prompt_tokens"])
        m.prefix_hits.labels(*labels).inc(usage["prompt_tokens_details"]["cached_tokens"])
        for c in job.choices:
            reason = c.finish_reason if status == "ok" and c.finish_reason else status
            m.requests.labels(*labels, reason).inc()

