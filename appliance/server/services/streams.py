"""The n engine streams of one HTTP request, merged; and the disconnect race.

Each choice's `Engine.submit` iterator is pumped by its own task into one queue, so the
handler reads (choice index, chunk) pairs in arrival order. Closing the merge cancels the
pumps; a cancelled pump is inside `submit`, whose `finally` aborts the engine request,
and the core frees its pages in the next step. `close` is synchronous on purpose: it is
called from `finally` blocks that may already be cancelled (anyio re-cancels every await
inside a cancelled scope), where an await would be interrupted before it finished.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable
from typing import Any, TypeVar

from appliance.server.errors import ApiError
from engine.scheduler.request import OutputChunk, Request

T = TypeVar("T")


class ClientDisconnected(ApiError):
    status, code = 499, "client_closed_request"


class ChoiceStreams:
    def __init__(self, engine: Any, requests: list[Request]) -> None:
        self._queue: asyncio.Queue[tuple[int, OutputChunk | BaseException]] = asyncio.Queue()
        self._buffer: deque[tuple[int, OutputChunk | BaseException]] = deque()
        self._open = set(range(len(requests)))
        self._tasks = [asyncio.create_task(self._pump(i, engine, r))
                       for i, r in enumerate(requests)]

    async def _pump(self, index: int, engine: Any, request: Request) -> None:
        stream = engine.submit(request)
        try:
            async for chunk in stream:
                self._queue.put_nowait((index, chunk))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine error: the reader raises it
            self._queue.put_nowait((index, exc))
        finally:
            await stream.aclose()

    async def prime(self) -> None:
        """Wait until every choice has produced its first chunk; raise the first error
        (a rejected request: quota, context, an invalid parameter) before any is sent."""
        started: set[int] = set()
        while len(started) < len(self._tasks):
            index, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            self._buffer.append((index, item))
            started.add(index)

    def __aiter__(self) -> ChoiceStreams:
        return self

    async def __anext__(self) -> tuple[int, OutputChunk]:
        """The next (choice, chunk) until every choice finished; engine errors raise."""
        if not self._open:
            raise StopAsyncIteration
        index, item = self._buffer.popleft() if self._buffer else await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item.finish_reason is not None:
            self._open.discard(index)
        return index, item

    def close(self) -> None:
        """Abort every choice still running (synchronous: see the module docstring)."""
        for task in self._tasks:
            task.cancel()


async def until_disconnect(receive: Any, work: Awaitable[T]) -> T:
    """`work`'s result, unless the client disconnects first (ClientDisconnected; `work`
    is cancelled). `receive` is the request's ASGI receive, its body already read."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientDisconnected("the client closed the connection")
    return task.result()


async def _disconnected(receive: Any) -> None:
    while True:
        message = await receive()
        if message.get("type") == "http.disconnect":
            return
