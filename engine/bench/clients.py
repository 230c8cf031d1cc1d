"""`mbufo bench clients`: one heavy client and several light ones on the same model.

The scheduler's client is the API key (the server maps each key to a client id), so the
same scenario runs in-process with client ids. First each light client's request runs
alone on the idle target (solo TTFT, median); then the heavy client submits many
requests at once and, once its streams are running, every light client submits one. The
light clients' median TTFT under that load, divided by the solo median, is the figure
(goal: within 2x).

Light clients arrive `light_gap_s` apart (default: twice the solo median, so they do not
queue behind each other and the figure isolates the heavy client's effect). With a gap of
0 they arrive together: on a compute-bound device their own prefills then serialize, and
the median is >= about 2.5x solo even with no heavy client at all.

Also reported: the heavy streams' inter-token gaps from the first light request's send to
the last light request's first token (`heavy_itl_during_light_ms`: what each arrival's
step cost the streams), and, from targets that keep them, the engine's steps over its ITL
target during the whole run (`slow_steps`: count and count by path).
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

from engine.bench.prompts import PromptFactory
from engine.bench.report import latency_ms, ms
from engine.bench.target import Target

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


async def run_clients(target: Target, factory: PromptFactory, *, heavy_requests: int = 12,
                      light_clients: int = 4, prompt_tokens: int = 128, max_tokens: int = 16,
                      heavy_tokens: int = 64, light_gap_s: float | None = None,
                      progress: Progress = log.info) -> dict[str, Any]:
    await target.complete(factory.make(16), 1, client="warmup")
    solo = []
    for i in range(light_clients):
        result = await target.complete(factory.make(prompt_tokens), max_tokens,
                                       client=f"light{i}")
        solo.append(result.ttft_s)
    progress(f"solo light TTFT median {statistics.median(solo) * 1e3:.0f} ms")
    started = asyncio.Event()
    heavy = [asyncio.create_task(target.complete(factory.make(prompt_tokens), heavy_tokens,
                                                 client="heavy", first_token=started))
             for _ in range(heavy_requests)]
    await started.wait()
    await asyncio.sleep(0.5)  # the heavy client's streams are running
    gap = 2 * statistics.median(solo) if light_gap_s is None else light_gap_s
    progress(f"{heavy_requests} heavy requests running; {light_clients} light clients submit "
             f"{gap:.1f} s apart")

    async def light_request(i: int):
        await asyncio.sleep(i * gap)
        return await target.complete(factory.make(prompt_tokens), max_tokens,
                                     client=f"light{i}")

    light = await asyncio.gather(*(light_request(i) for i in range(light_clients)))
    heavy_results = await asyncio.gather(*heavy)
    loaded = [r.ttft_s for r in light]
    solo_ms, loaded_ms = statistics.median(solo) * 1e3, statistics.median(loaded) * 1e3
    start, end = min(r.sent for r in light), max(r.first_token_time for r in light)
    during = [b - a for r in heavy_results for a, b in r.intervals() if b > start and a < end]
    out = {
        "heavy_requests": heavy_requests, "light_clients": light_clients,
        "prompt_tokens": prompt_tokens, "light_gap_s": round(gap, 3),
        "solo_light_ttft_ms": round(solo_ms, 2),
        "loaded_light_ttft_ms": round(loaded_ms, 2),
        "light_ttft_ratio": round(loaded_ms / solo_ms, 3),
        "loaded_light_ttft_ms_all": [ms(t) for t in loaded],
        "heavy_ttft_ms_median": ms(statistics.median(r.ttft_s for r in heavy_results)),
        "heavy_itl_during_light_ms": latency_ms(during),
    }
    steps = target.slow_steps()
    if steps is not None:
        out["slow_steps"] = {"count": len(steps),
                             "by_path": dict(Counter(s["path"] for s in steps))}
    return out
