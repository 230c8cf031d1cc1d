"""`mbufo bench fairness`: DESIGN.md's fairness scenario, one definition for CLI and tests.

N streams decode a fixed number of tokens (ignore_eos); after 1.5 s of decoding (counted
from the moment every stream has its first token, so that a slow machine still has a
steady baseline) a long prompt is injected (max_tokens 1); 0.3 s after that a short
prompt (~40 words) arrives (max_tokens 4). Every prompt is fresh; a reported prefix-cache
hit on the solo, short or long request fails the run. Reported:

- `solo_ttft_ms`: median TTFT of 3 solo runs of a short request on the idle target;
- `loaded_short_ttft_ms`: the short request's TTFT during the injection;
- `fairness_ratio`: loaded_short_ttft_ms / solo_ttft_ms (1.0 = the long prompt cost
  the newcomer nothing);
- `long_ttft_ms`: the long prompt's TTFT;
- `itl_baseline_ms` and `itl_during_injection_ms` ({mean, p95, max}): the streams'
  inter-token intervals in steady state before the injection (after every stream has its
  first token, ending before the long prompt is sent) vs every interval that overlaps the
  injection window (ends after the long prompt was sent and starts before its first token);
- `itl_target_ms` (in-process targets: the scheduler's ITL target as the long prompt got
  its first token) and `itl_over_target_share`: the share of those intervals above it.

The stream length is estimated from a warm-up request so that the streams outlast the
injection; if they still finish before the long and short prompts have their first token,
the loaded run is repeated with twice as many stream tokens (up to the context).

A target that declares itself serial (`is_serial`: one request at a time, the others
queue, e.g. llama-cpp-python's server) runs the same requests at the same moments: the
injection counts from the first stream's first token (the others wait in its queue), the
baseline comes from the streams that started before the injection, and the streams are
not required to outlast it (they cannot: the injected prompts queue behind them). Its
ITL then shows no stall, and the short request's TTFT includes the queued streams.
A target that runs requests one after another without declaring it is refused.
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.bench.prefill import check_fresh, prompt_tokens
from engine.bench.prompts import PromptFactory
from engine.bench.report import format_table, latency_ms, ms
from engine.bench.target import Prompt, RequestResult, Target
from engine.errors import EngineError

log = logging.getLogger(__name__)

SCENARIO_LONG_TOKENS = {"A": 2048, "B": 4096}
RESULT_KEYS = ("solo_ttft_ms", "loaded_short_ttft_ms", "fairness_ratio", "long_ttft_ms",
               "itl_baseline_ms", "itl_during_injection_ms")
Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class FairnessSpec:
    streams: int = 2
    long_tokens: int = 2048
    short_tokens: int = 48  # about 40 words of the salted word list
    stream_prompt_tokens: int = 32
    stream_tokens: int | None = None  # None: estimated from the warm-up
    max_stream_tokens: int = 4000  # the context left after a stream's prompt
    inject_after_s: float = 1.5
    short_after_s: float = 0.3
    solo_runs: int = 3


@dataclass(slots=True)
class LoadedRun:
    streams: list[RequestResult]
    long: RequestResult
    short: RequestResult
    long_prompt: Prompt | None = None
    short_prompt: Prompt | None = None

    def streams_outlast(self) -> bool:
        """Every stream was still decoding when both injected prompts had their first token."""
        end = max(self.long.first_token_time, self.short.first_token_time)
        return all(s.token_times and s.last_token_time >= end for s in self.streams)


def summarize_fairness(solo: Sequence[RequestResult], run: LoadedRun,
                       itl_target_ms: float | None = None) -> dict[str, Any]:
    t_inject = run.long.sent
    t_long_first = run.long.first_token_time
    # the streams that had started before the injection (all of them unless the target is
    # serial, where the others wait in its queue)
    steady_from = max(t for t in (s.first_token_time for s in run.streams) if t <= t_inject)
    baseline = [end - start for s in run.streams for start, end in s.intervals()
                if start >= steady_from and end <= t_inject]
    during = [end - start for s in run.streams for start, end in s.intervals()
              if end > t_inject and start < t_long_first]
    if not baseline:
        raise EngineError("fairness: no steady decode interval before the injection "
                          "(the streams started too slowly)")
    solo_ttft = statistics.median(r.ttft_s for r in solo)
    loaded = run.short.ttft_s
    return {
        "solo_ttft_ms": ms(solo_ttft),
        "loaded_short_ttft_ms": ms(loaded),
        "fairness_ratio": round(loaded / solo_ttft, 3),
        "long_ttft_ms": ms(run.long.ttft_s),
        "itl_baseline_ms": latency_ms(baseline),
        "itl_during_injection_ms": latency_ms(during),
        "itl_target_ms": None if itl_target_ms is None else round(itl_target_ms, 2),
        "itl_over_target_share": None if itl_target_ms is None or not during else round(
            sum(d * 1e3 > itl_target_ms for d in during) / len(during), 3),
    }


def summarize_slow_steps(steps: Sequence[dict[str, Any]], run: LoadedRun,
                         keep: int = 8) -> dict[str, Any]:
    """The target's steps over its ITL target while the loaded run's streams decoded (from
    the first stream's request to the last one's last token): how many (of those the
    target still held), by path (eager, replay, capture, ahead), and the `keep` slowest,
    each timed from the long prompt's injection (negative: before it)."""
    start = min(s.sent for s in run.streams)
    end = max(s.last_token_time for s in run.streams if s.token_times)
    inside = [x for x in steps if start <= x["at_s"] <= end]
    by_path = Counter(x["path"] for x in inside)
    slowest = sorted(inside, key=lambda x: -x["ms"])[:keep]
    return {
        "count": len(inside),
        "by_path": dict(sorted(by_path.items())),
        "slowest": [{"at_ms": ms(x["at_s"] - run.long.sent), "ms": round(x["ms"], 2),
                     "path": x["path"], "decode_rows": x["decode_rows"],
                     "prefill_tokens": x["prefill_tokens"]} for x in slowest],
    }


def estimate_stream_tokens(warm: RequestResult, spec: FairnessSpec) -> int:
    """Tokens that keep a stream busy through the injection, with margin: the window is
    the two delays, twice the long prompt's solo prefill time, one second and the warm-up's
    TTFT (the streams' own start); a solo ITL
    is no longer than a loaded one, so the count is on the safe side."""
    prefill_s = warm.ttft_s * spec.long_tokens / max(1, warm.prompt_tokens or 1)
    itls = warm.itls_s()  # their mean: servers that send tokens in bursts have tiny medians
    itl = sum(itls) / len(itls) if itls else 0.05
    window = spec.inject_after_s + spec.short_after_s + 2 * prefill_s + 1.0 + warm.ttft_s
    return min(spec.max_stream_tokens, math.ceil(1.25 * window / max(itl, 1e-4)))


async def _all_started(streams: list[asyncio.Future], started: list[asyncio.Event]) -> None:
    """Wait until every stream has its first token; a stream that fails fails the run."""
    waits = {asyncio.ensure_future(e.wait()) for e in started}
    watch = waits | set(streams)
    try:
        while not all(e.is_set() for e in started):
            done, watch = await asyncio.wait(watch, return_when=asyncio.FIRST_COMPLETED)
            for task in done - waits:
                stream = task.result()  # raises what the stream raised
                if not all(e.is_set() for e in started):
                    raise EngineError(
                        f"fairness: a stream finished ({stream.completion_tokens} tokens, "
                        f"{stream.finish_reason}) before every stream had started: the target "
                        "runs requests one after another, the scenario needs them concurrent")
    finally:
        for wait in waits:
            wait.cancel()


async def _loaded_run(target: Target, factory: PromptFactory, spec: FairnessSpec,
                      stream_tokens: int,
                      sleep: Callable[[float], Awaitable[Any]]) -> LoadedRun:
    stream_prompts = [factory.make(spec.stream_prompt_tokens) for _ in range(spec.streams)]
    long_prompt = factory.make(spec.long_tokens)
    short_prompt = factory.make(spec.short_tokens)
    started = [asyncio.Event() for _ in stream_prompts]
    streams = [asyncio.ensure_future(target.complete(p, stream_tokens, client=f"stream-{i}",
                                                     first_token=e))
               for i, (p, e) in enumerate(zip(stream_prompts, started, strict=True))]
    try:
        if target.is_serial:  # the other streams wait in the target's queue
            await _all_started(streams[:1], started[:1])
        else:
            await _all_started(streams, started)
        await sleep(spec.inject_after_s)  # of steady decoding by all N streams
        long = asyncio.ensure_future(target.complete(long_prompt, 1, client="long"))
        await sleep(spec.short_after_s)
        short = asyncio.ensure_future(target.complete(short_prompt, 4, client="short"))
        results = await asyncio.gather(*streams, long, short)
    except BaseException:
        for task in streams:
            task.cancel()
        raise
    return LoadedRun(list(results[:-2]), results[-2], results[-1], long_prompt, short_prompt)


def _check_streams_ran_out(run: LoadedRun, stream_tokens: int) -> None:
    """Streams must stop at max_tokens, not at an end-of-generation token."""
    for stream in run.streams:
        if stream.completion_tokens < stream_tokens and stream.finish_reason != "length":
            raise EngineError(
                f"fairness: a stream ended after {stream.completion_tokens} of {stream_tokens} "
                f"tokens ({stream.finish_reason}): the target does not honor ignore_eos")


async def run_fairness(target: Target, factory: PromptFactory, spec: FairnessSpec,
                       progress: Progress = log.info,
                       sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
                       ) -> dict[str, Any]:
    slack = target.cache_slack
    await target.complete(factory.make(8), 2, client="warmup")
    warm_prompt = factory.make(min(256, spec.long_tokens))
    warm = await target.complete(warm_prompt, 16, client="warmup")
    warm.prompt_tokens = await prompt_tokens(target, warm_prompt, warm)  # usage-less streams
    solo = []
    for i in range(spec.solo_runs):
        solo.append(await target.complete(factory.make(spec.short_tokens), 4, client="short"))
        progress(f"fairness [{target.name}] solo {i + 1}: TTFT {ms(solo[-1].ttft_s)} ms")
    stream_tokens = spec.stream_tokens or estimate_stream_tokens(warm, spec)
    while True:
        progress(f"fairness [{target.name}] {spec.streams} streams x {stream_tokens} tokens, "
                 f"long prompt {spec.long_tokens} tokens after {spec.inject_after_s} s")
        run = await _loaded_run(target, factory, spec, stream_tokens, sleep)
        itl_target = target.itl_target_ms()
        _check_streams_ran_out(run, stream_tokens)
        if run.streams_outlast() or target.is_serial:
            break
        if stream_tokens >= spec.max_stream_tokens:
            raise EngineError(
                f"fairness: the streams finished before the injected prompts got their first "
                f"token even at {stream_tokens} tokens; give a larger context (-c)")
        stream_tokens = min(spec.max_stream_tokens, 2 * stream_tokens)
        progress(f"  the streams ended too early; again with {stream_tokens} tokens")
    known = [check_fresh(r, f"fairness {what}", slack)
             for what, r in [("solo", s) for s in solo] + [("short", run.short),
                                                            ("long", run.long)]]
    out = {
        "bench": "fairness",
        "target": target.describe(),
        "streams": spec.streams,
        "stream_tokens": stream_tokens,
        "long_prompt_tokens": await prompt_tokens(target, run.long_prompt, run.long),
        "short_prompt_tokens": await prompt_tokens(target, run.short_prompt, run.short),
        "cache_check": "passed" if all(known) else "unknown (the target reports no cache hits)",
    }
    out.update(summarize_fairness(solo, run, itl_target))
    steps = target.slow_steps()
    if steps is not None:
        out["slow_steps"] = slow = summarize_slow_steps(steps, run)
        progress(f"fairness [{target.name}] {slow['count']} steps over the ITL target while "
                 f"the streams ran {slow['by_path'] or ''}")
    return out


def fairness_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per configuration; the ITL target's columns are "-" for a target that has
    none (a peer over HTTP)."""
    headers = ["config", "solo TTFT ms", "loaded short TTFT ms", "ratio", "long TTFT ms",
               "ITL base mean/p95/max ms", "ITL injection mean/p95/max ms", "ITL target ms",
               "over target", "slow steps"]

    def triple(stats: dict[str, Any]) -> str:
        return "/".join("-" if stats[k] is None else f"{stats[k]:.1f}"
                        for k in ("mean", "p95", "max"))

    def share(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.1f}%"

    def slow(summary: dict[str, Any] | None) -> str:
        if summary is None:
            return "-"
        paths = ", ".join(f"{n} {path}" for path, n in sorted(summary["by_path"].items()))
        return f"{summary['count']} ({paths})" if paths else str(summary["count"])

    rows = [[r.get("config", "default"), r["solo_ttft_ms"], r["loaded_short_ttft_ms"],
             r["fairness_ratio"], r["long_ttft_ms"], triple(r["itl_baseline_ms"]),
             triple(r["itl_during_injection_ms"]), r.get("itl_target_ms"),
             share(r.get("itl_over_target_share")), slow(r.get("slow_steps"))]
            for r in results]
    return format_table(headers, rows)
