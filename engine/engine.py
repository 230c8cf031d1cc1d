"""Engine: the loop thread around EngineCore, and the submit/abort API for many callers.

One thread per loaded model steps the core; callers talk to it through a thread-safe inbox
and per-request sinks, so HTTP work can never stall a step. `submit` is an async iterator
for the server; `stream` is its blocking twin for the CLI and benchmarks. A caller that
stops iterating (a disconnect) aborts its request: the core frees its pages next step.
An embedding model's jobs (engine/embed.py, `embed`) run on the same thread, one input a
turn between steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import torch

from engine.core import EngineCore
from engine.embed import EmbedJob, PoolingRun, next_job
from engine.errors import EngineError, InvalidRequest, OutOfKVPages
from engine.scheduler.request import OutputChunk, Request

log = logging.getLogger(__name__)

Sink = Callable[[OutputChunk | BaseException], None]
# The longest the loop thread waits for the stream readers it wakes (a slow one is then
# left to run beside the next step).
HANDBACK_BASE_S, HANDBACK_PER_READER_S = 0.001, 0.0001
# Quiet time before the loop thread runs the core's idle work (deferred graph captures)
IDLE_GRACE_S = 0.5
STATS_INTERVAL_S = 0.05  # EngineStats at most this often while steps run (and when idle)


class _AsyncSink:
    """Hands items to an asyncio queue on its loop. The loop thread gives a step's chunks
    for one event loop to it in one call (one wake-up of that loop, not one per stream)."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, chunks: asyncio.Queue) -> None:
        self.loop, self.queue = loop, chunks

    def __call__(self, item: OutputChunk | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class _Handback:
    """Where the loop thread waits, GIL released, until the stream readers it woke have
    taken their chunks (bounded). Readers woken while the loop thread steps would take the
    GIL at each of its torch calls and give it back a thread switch later; served here,
    back to back, a woken reader costs about one switch."""

    __slots__ = ("lock", "owed")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()  # held: released by the last reader owed
        self.owed: deque[None] = deque()  # one entry per woken reader not yet back

    def pass_on(self) -> None:
        """A woken reader took its chunks and goes back to sleep."""
        try:
            self.owed.pop()  # atomic under the GIL: exactly one reader empties it
        except IndexError:  # the loop thread stopped waiting for this one
            return
        if not self.owed:
            try:
                self.lock.release()
            except RuntimeError:
                pass

    def run(self, boxes: list[_Mailbox], timeout: float) -> None:
        self.owed.extend(None for _ in boxes)
        for box in boxes:
            box.ring(self)
        self.lock.acquire(timeout=timeout)
        self.owed.clear()  # a slow reader is left to run beside the next step
        self.lock.acquire(blocking=False)  # held again however the wait ended


class _Mailbox:
    """A stream's chunks for one consuming thread: appended without a lock; the reader
    sleeps only when none is waiting and takes every waiting chunk without sleeping."""

    __slots__ = ("items", "bell", "is_asleep", "handback")

    def __init__(self) -> None:
        self.items: deque[OutputChunk | BaseException] = deque()
        self.bell = threading.Lock()
        self.bell.acquire()  # held: the reader sleeps on it until ring() releases it
        self.is_asleep = False
        self.handback: _Handback | None = None  # to pass on when it sleeps again

    def __call__(self, item: OutputChunk | BaseException) -> None:
        if self.put(item):
            self.ring(None)

    def put(self, item: OutputChunk | BaseException) -> bool:
        """Append; True when the reader sleeps and must be rung."""
        self.items.append(item)
        if not self.is_asleep:
            return False
        self.is_asleep = False
        return True

    def ring(self, handback: _Handback | None) -> None:
        self.handback = handback
        try:
            self.bell.release()
        except RuntimeError:  # already rung
            pass

    def get(self, timeout: float | None) -> OutputChunk | BaseException:
        items = self.items
        while not items:
            handback, self.handback = self.handback, None
            self.is_asleep = True
            if items:  # a put between the check and the flag did not see it asleep
                self.is_asleep = False
                break
            if handback is not None:
                handback.pass_on()
            if not self.bell.acquire(timeout=-1 if timeout is None else timeout):
                self.is_asleep = False
                raise queue.Empty
        return items.popleft()


def _put_all(items: list[tuple[asyncio.Queue, OutputChunk]]) -> None:
    for chunks, item in items:
        chunks.put_nowait(item)


class Engine:
    def __init__(self, core: EngineCore, name: str = "model", loaded: Any = None) -> None:
        self.core = core
        self.name = name
        self.loaded = loaded  # engine.loader.LoadedModel when built from a file
        self._inbox: list[tuple[str, Any]] = []
        self._sinks: dict[str, Sink] = {}
        self._handback = _Handback()
        self._wake = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self._stats: Any = None
        self._stats_due = 0.0  # time.monotonic() after which the next step refreshes it
        self._stats_seqs = -1  # live sequences at the last refresh
        self._embed_jobs: list[EmbedJob] = []  # loop thread only, in arrival order
        self._embed_client: str | None = None  # whose input ran last
        self.error: BaseException | None = None

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> Engine:
        self._running = True
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop; requests still running end with finish_reason "abort"."""
        with self._wake:
            self._running = False
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- caller side -----------------------------------------------------------------
    def _post(self, kind: str, payload: Any) -> None:
        with self._wake:
            if kind in ("add", "embed") and not self._running:  # under the loop's lock
                raise EngineError(f"engine '{self.name}' is not running")
            self._inbox.append((kind, payload))
            self._wake.notify()

    def add(self, request: Request, sink: Sink) -> None:
        """Queue a request; every chunk (or the error that rejected it) goes to `sink`."""
        self._post("add", (request, sink))

    def abort(self, request_id: str) -> None:
        self._post("abort", request_id)

    async def submit(self, request: Request) -> AsyncIterator[OutputChunk]:
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[OutputChunk | BaseException] = asyncio.Queue()
        self.add(request, _AsyncSink(loop, chunks))
        finished = False
        try:
            while not finished:
                item = await chunks.get()
                finished = isinstance(item, BaseException) or item.finish_reason is not None
                yield _checked(item)
        finally:
            if not finished:
                self.abort(request.id)

    def stream(self, request: Request, timeout: float | None = None) -> Iterator[OutputChunk]:
        chunks = _Mailbox()
        self.add(request, chunks)
        finished = False
        try:
            while not finished:
                item = chunks.get(timeout=timeout)
                finished = isinstance(item, BaseException) or item.finish_reason is not None
                yield _checked(item)
        finally:
            if not finished:
                self.abort(request.id)

    async def embed(self, inputs: list[list[int]], client_id: str = "local"
                    ) -> list[torch.Tensor]:
        """The pooled output-norm states (hidden,) float32 of each input, in order (an
        embedding model's: loaded.config.pooling); clients' inputs run in turn. Raises
        InvalidRequest for a model that pools nothing, EngineError when the engine stops or
        fails first."""
        pooling = getattr(getattr(self.loaded, "config", None), "pooling", None)
        if pooling is None:
            raise InvalidRequest(f"the model '{self.name}' is not an embedding model (its "
                                 f"GGUF sets no pooling_type)")
        loop = asyncio.get_running_loop()
        result: asyncio.Future[list[torch.Tensor]] = loop.create_future()

        def done(out: list[torch.Tensor] | BaseException) -> None:
            def settle() -> None:
                if result.done():
                    return
                if isinstance(out, BaseException):
                    result.set_exception(out)
                else:
                    result.set_result(out)
            loop.call_soon_threadsafe(settle)

        self._post("embed", EmbedJob([list(ids) for ids in inputs], done, client_id))
        return await result

    def stats(self) -> Any:
        """The core's EngineStats (safe to read from any thread): as of the last step when
        sequences came or went, or the engine went idle; otherwise at most STATS_INTERVAL_S
        old (building it every step would cost as much as a step's own host work)."""
        return self._stats

    # ---- loop thread -----------------------------------------------------------------
    def _drain_inbox(self) -> None:
        # After IDLE_GRACE_S with nothing to do, the core's idle work runs one piece at a
        # time (a graph capture: ~0.1 s), outside the lock so that callers can post
        # meanwhile; requests that follow each other closely never wait for it.
        more_idle_work = True
        while True:
            with self._wake:
                if not self._quiet():
                    break
                if not more_idle_work:
                    self._wake.wait()
                    continue
                self._wake.wait(IDLE_GRACE_S)
                if not self._quiet():
                    break
            more_idle_work = self.core.idle()
            if more_idle_work:
                self._refresh_stats()  # e.g. the graphs it now holds
        with self._wake:
            inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "add":
                request, sink = payload
                try:
                    self.core.add(request)
                    self._sinks[request.id] = sink
                except EngineError as exc:
                    sink(exc)
            elif kind == "abort":
                self.core.abort(payload)
            elif kind == "embed":
                self._embed_jobs.append(payload)

    def _quiet(self) -> bool:
        """No request posted or in the core (the loop would sleep); under `_wake`."""
        return self._running and not self._inbox and not self.core.has_work() and \
            not self._embed_jobs

    def _deliver(self, chunks: list[OutputChunk]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, OutputChunk]]] = {}
        woken: list[_Mailbox] = []
        for chunk in chunks:
            sink = self._sinks.get(chunk.request_id)
            if sink is None:
                continue
            if chunk.finish_reason is not None:
                del self._sinks[chunk.request_id]
            if isinstance(sink, _AsyncSink):
                batches.setdefault(sink.loop, []).append((sink.queue, chunk))
            elif isinstance(sink, _Mailbox):
                if sink.put(chunk):
                    woken.append(sink)
            else:
                sink(chunk)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)
        if woken:
            self._handback.run(woken, HANDBACK_BASE_S + HANDBACK_PER_READER_S * len(woken))

    def _embed_one(self) -> None:
        """One chunk of an embedding input, between steps: the input under way, else the
        next client's next input (engine/embed.py's next_job). With no page free now it
        waits for a later turn while requests run (they give pages back), else fails."""
        index = next_job(self._embed_jobs, self._embed_client)
        job = self._embed_jobs[index]
        try:
            if job.run is None:
                job.run = PoolingRun(self.core.runner, job.inputs[len(job.vectors)],
                                     self.loaded.config.pooling, self.core.config.prefill_chunk)
                self._embed_client = job.client_id
            vector = job.run.step()
        except OutOfKVPages as exc:
            if self.core.has_work():
                return
            self._end_embed(index, exc)
            return
        except EngineError as exc:
            self._end_embed(index, exc)
            return
        if vector is None:
            return
        job.run = None
        job.vectors.append(vector)
        if len(job.vectors) == len(job.inputs):
            del self._embed_jobs[index]
            job.done(job.vectors)

    def _end_embed(self, index: int, result: BaseException) -> None:
        job = self._embed_jobs.pop(index)
        if job.run is not None:
            job.run.close()
        job.done(result)

    def _refresh_stats(self) -> None:
        now, num_seqs = time.monotonic(), len(self.core.scheduler.seqs)
        if now >= self._stats_due or num_seqs != self._stats_seqs or not self.core.has_work():
            self._stats = self.core.stats()
            self._stats_due, self._stats_seqs = now + STATS_INTERVAL_S, num_seqs

    def _loop(self) -> None:
        try:
            while True:
                self._drain_inbox()
                if not self._running:
                    break
                if self._embed_jobs:
                    self._embed_one()
                if self.core.has_work():
                    chunks = self.core.step()
                    # a step that ends a request refreshes stats before its chunks go out:
                    # a caller that has its request's end then reads stats without it
                    ends = any(c.finish_reason is not None for c in chunks)
                    if ends:
                        self._refresh_stats()
                    self._deliver(chunks)
                    if not ends:
                        self._refresh_stats()
        except BaseException as exc:  # a bug in a step: fail every caller, loudly
            log.exception("engine '%s' loop crashed", self.name)
            self.error = exc
            failure = EngineError(f"engine '{self.name}' failed: {exc}")
            for sink in self._sinks.values():
                sink(failure)
            self._sinks.clear()
            while self._embed_jobs:
                self._end_embed(0, failure)
            self._running = False
            return
        for request_id in list(self._sinks):
            self.core.abort(request_id)
        while self.core.has_work():
            self._deliver(self.core.step())
        with self._wake:  # requests posted after the last drain are answered too
            late, self._inbox = self._inbox, []
        stopped = EngineError(f"engine '{self.name}' stopped")
        for sink in [*self._sinks.values(), *(p[1] for k, p in late if k == "add")]:
            sink(stopped)
        self._sinks.clear()
        self._embed_jobs.extend(p for k, p in late if k == "embed")
        while self._embed_jobs:
            self._end_embed(0, stopped)


def _checked(item: OutputChunk | BaseException) -> OutputChunk:
    """A chunk, or the error the loop sent instead (the request is over: no abort)."""
    if isinstance(item, BaseException):
        raise item
    return item
