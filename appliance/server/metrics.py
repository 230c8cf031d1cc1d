"""Prometheus metrics, named like vLLM's (`vllm:` -> `mbufo:`), labelled by model and key id.

Histograms and counters are observed by the generation service as chunks arrive; gauges
(KV usage, running/waiting requests, per-client queues) are read from each engine's
EngineStats at scrape time. The key label is the key's public id, never its secret.

The engine reports no admission time, so `request_queue_time_seconds` comes from
`QueueWatch`: while requests wait, it looks at each engine's published stats every
POLL_S and observes a request's wait when it first shows up resident (resolution: one
engine step or POLL_S, whichever is longer); a request whose first token arrives before
a poll saw it resident is observed then, an upper bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
POLL_S = 0.02
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, router: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model", "key"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        def count(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=self.registry)

        self.ttft = hist("mbufo:time_to_first_token_seconds",
                         "Time from request arrival to the first token.", LATENCY_BUCKETS)
        self.itl = hist("mbufo:inter_token_latency_seconds",
                        "Time between consecutive output tokens.", ITL_BUCKETS)
        self.queue_time = hist("mbufo:request_queue_time_seconds",
                               "Time a request waited for a session slot.", LATENCY_BUCKETS)
        self.e2e = hist("mbufo:e2e_request_latency_seconds",
                        "Time from request arrival to its last token.", LATENCY_BUCKETS)
        self.prompt_tokens = count("mbufo:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = count("mbufo:generation_tokens", "Tokens generated.")
        self.prefix_queries = count("mbufo:prefix_cache_queries",
                                    "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = count("mbufo:prefix_cache_hits",
                                 "Prompt tokens found in the prefix cache.")
        self.requests = count("mbufo:request_success", "Finished requests by finish reason.",
                              ("finished_reason",))
        self.registry.register(EngineCollector(router))
        self.queue = QueueWatch(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector:
    """Gauges from each loaded model's EngineStats, read when Prometheus scrapes."""

    def __init__(self, router: Any) -> None:
        self.router = router

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        kv = GaugeMetricFamily("mbufo:kv_cache_usage_perc",
                               "Fraction of KV pages in use (0-1).", labels=["model"])
        running = GaugeMetricFamily("mbufo:num_requests_running",
                                    "Requests holding a session slot.", labels=["model"])
        waiting = GaugeMetricFamily("mbufo:num_requests_waiting",
                                    "Requests queued for a session slot.", labels=["model"])
        queue = GaugeMetricFamily("mbufo:client_queue_length",
                                  "Queued requests per client.", labels=["model", "key"])
        wait = GaugeMetricFamily("mbufo:client_oldest_wait_seconds",
                                 "Wait of each client's oldest queued request.",
                                 labels=["model", "key"])
        for handle in self.router.handles():
            stats = handle.engine.stats()
            name = handle.name
            if stats is None:  # no step yet
                kv.add_metric([name], 0.0)
                running.add_metric([name], 0)
                waiting.add_metric([name], 0)
                continue
            total = sum(g.num_pages for g in stats.kv)
            kv.add_metric([name], sum(g.num_used for g in stats.kv) / total if total else 0.0)
            num_running = sum(1 for s in stats.sessions if s.phase in ("prefill", "decode"))
            running.add_metric([name], num_running)
            waiting.add_metric([name], stats.num_waiting)
            for client in stats.clients:
                queue.add_metric([name, client.client_id], client.num_waiting)
                wait.add_metric([name, client.client_id], client.oldest_wait_s)
        yield from (kv, running, waiting, queue, wait)


class QueueWatch:
    """Observes each request's wait for a session slot (see the module docstring)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._pending: dict[str, tuple[Any, float, str, str]] = {}
        self._task: asyncio.Task | None = None

    def add(self, request_id: str, handle: Any, key: str) -> None:
        self._pending[request_id] = (handle, time.perf_counter(), handle.name, key)

    def first_token(self, request_id: str) -> None:
        """A token arrived before a poll saw the request resident: the wait was at most
        until now (an upper bound; the request was admitted before its prefill)."""
        entry = self._pending.pop(request_id, None)
        if entry is not None:
            _, start, model, key = entry
            self.metrics.queue_time.labels(model, key).observe(time.perf_counter() - start)

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            if self._pending:
                self.poll()

    def poll(self) -> None:
        now = time.perf_counter()
        seen: dict[int, set[str]] = {}
        for request_id, (handle, start, model, key) in list(self._pending.items()):
            resident = seen.get(id(handle))
            if resident is None:
                stats = handle.engine.stats()
                resident = seen[id(handle)] = set() if stats is None else {
                    s.request_id for s in stats.sessions if s.phase != "waiting"}
            if request_id in resident:
                del self._pending[request_id]
                self.metrics.queue_time.labels(model, key).observe(now - start)
