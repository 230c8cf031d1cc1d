"""bench/gpu/engine_bench.py's run_batch: the streams read by a thread each (Engine.stream)
or as tasks on one event loop (Engine.submit, the server's way), every chunk counted."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))
import engine_bench  # noqa: E402


class FakeEngine:
    """Each stream yields max_tokens one-token chunks; records which API served it."""

    def __init__(self) -> None:
        self.calls, self.error = [], None

    def chunks(self, request):
        for _ in range(request.sampling.max_tokens):
            yield SimpleNamespace(token_ids=[1])

    def stream(self, request, timeout=None):
        self.calls.append("stream")
        yield from self.chunks(request)

    async def submit(self, request):
        self.calls.append("submit")
        for chunk in self.chunks(request):
            yield chunk


@pytest.mark.parametrize("consumers,api", [("threads", "stream"), ("asyncio", "submit")])
def test_run_batch_reads_every_stream_either_way(consumers, api):
    engine = FakeEngine()
    row = engine_bench.run_batch(engine, [(1, 2)] * 3, 5, consumers=consumers)
    assert engine.calls == [api] * 3
    assert row["concurrency"] == 3 and row["total_tok_s"] > 0 and row["steady_tok_s"] > 0


def test_run_batch_rejects_other_consumers():
    with pytest.raises(ValueError, match="asyncio"):
        engine_bench.run_batch(FakeEngine(), [(1,)], 1, consumers="processes")
