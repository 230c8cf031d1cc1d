"""engine_bench.py's timings and profiles of the engine's decode step: the forward step
alone, torch's profiler over eager steps and over graph replays (the device's timeline:
span, busy and idle time, the last step kernel by kernel), and one stream's host time per
token by function. Each takes the engine's runner (or core) and frees what it allocates.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from engine.batch import ForwardBatch
from engine.kv.pool import SeqPages
from engine.sampler import SamplingParams
from engine.scheduler.request import Request

__all__ = ["decode_batch", "forward_ms", "last_step", "profile_decode", "profile_graph",
           "profile_steps", "step_shares", "sync", "timeline"]

def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_batch(runner, rows: int, context: int) -> tuple[ForwardBatch, list[SeqPages]]:
    """`rows` decode rows at position context - 1 over pages of (unwritten) context."""
    seqs: list[SeqPages] = []
    try:
        for _ in range(rows):
            seqs.append(SeqPages(runner.pool))
            seqs[-1].ensure(context)
    except Exception:
        for s in seqs:
            s.free()
        raise
    tables = {g: [s.table(g) for s in seqs] for g in runner.pool.groups}
    return ForwardBatch.build([([1000 + i], context - 1) for i in range(rows)], tables), seqs


def forward_ms(runner, rows: int, context: int, iters: int = 20) -> dict:
    """Mean wall time of runner.forward + sync for one decode batch (graph replay when on)."""
    batch, seqs = decode_batch(runner, rows, context)
    try:
        for _ in range(3):
            runner.forward(batch)
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            runner.forward(batch)
        sync()
        ms = (time.perf_counter() - t) / iters * 1e3
        return {"rows": rows, "ms": round(ms, 3), "tok_s": round(rows / ms * 1e3, 1)}
    finally:
        for s in seqs:
            s.free()


def _profiled(runner, rows: int, context: int, forward, steps: int, warm: int):
    """torch's profiler over `steps` calls of forward(batch) (after `warm` more) on `rows`
    decode rows at `context`."""
    from torch.profiler import ProfilerActivity, profile

    batch, seqs = decode_batch(runner, rows, context)
    try:
        for _ in range(warm):
            forward(batch)
        sync()
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                forward(batch)
            sync()
    finally:
        for s in seqs:
            s.free()
    return prof


def profile_decode(runner, rows: int, context: int, steps: int = 3, top: int = 24) -> dict:
    """Kernels of eager decode steps: launches per step, device time per step, the top ones."""
    prof = _profiled(runner, rows, context, runner.forward_eager, steps, 1)
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: -e.device_time_total)
    return {"rows": rows,
            "kernels_per_step": sum(e.count for e in kernels) / steps,
            "device_ms_per_step": sum(e.device_time_total for e in kernels) / steps / 1e3,
            "top": [{"name": e.key[:80], "per_step": e.count / steps,
                     "ms_per_step": round(e.device_time_total / steps / 1e3, 4)}
                    for e in kernels[:top]]}


def timeline(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(span, busy) of (start, end) intervals sorted by start: from the first start to the
    last end, and the length of their union (overlapping intervals count once)."""
    if not intervals:
        return 0.0, 0.0
    busy, end = 0.0, intervals[0][0]
    for lo, hi in intervals:
        busy += max(0.0, hi - max(end, lo))
        end = max(end, hi)
    return end - intervals[0][0], busy


def last_step(kernels: list[tuple[str, float, float]], steps: int) -> list[list]:
    """The last of `steps` equal steps of (name, start, end) kernels in start order (us):
    its kernels as [name (40 characters), start, end], the times from its first kernel's
    start; where the overlaps and the gaps sit, kernel by kernel."""
    per_step = len(kernels) // steps if steps > 0 else 0
    if per_step == 0:
        return []
    last = kernels[-per_step:]
    t0 = last[0][1]
    return [[name[:40], round(start - t0, 2), round(end - t0, 2)] for name, start, end in last]


def step_shares(last: list[list]) -> list[list]:
    """A step's time by kernel name from its last_step rows: each kernel's time from the
    previous kernel's end to its own end, summed per name, largest first, as [name, us,
    launches] (with programmatic dependent launches a kernel starts early, so its own
    duration overstates what it adds to the step; these add up to the step's span from the
    first kernel's end)."""
    shares: dict[str, list] = {}
    for (_, _, prev_end), (name, _, end) in zip(last[:-1], last[1:], strict=True):
        row = shares.setdefault(name, [name, 0.0, 0])
        row[1] += end - prev_end
        row[2] += 1
    return sorted(([n, round(us, 2), k] for n, us, k in shares.values()), key=lambda r: -r[1])


def profile_graph(runner, rows: int, context: int, steps: int = 5, top: int = 24) -> dict:
    """The kernels of decode steps replayed from their CUDA graph, on the device's timeline:
    per step the span from the first kernel's start to the last one's end, the time some
    kernel runs (the union of their intervals: programmatic dependent launches overlap),
    the sum of their durations, the idle time between them, the top kernels by time, and
    the last step kernel by kernel (last_step)."""
    prof = _profiled(runner, rows, context, runner.forward, steps, 3)
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.time_range.end > e.time_range.start),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return {"rows": rows, "error": "the profiler recorded no kernels of the replays"}
    span, busy = timeline([(e.time_range.start, e.time_range.end) for e in kernels])
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:80], []).append(e.time_range.end - e.time_range.start)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    last = last_step([(e.name, e.time_range.start, e.time_range.end) for e in kernels], steps)
    return {"rows": rows, "steps": steps, "kernels_per_step": len(kernels) / steps,
            "last_step": last, "step_shares": step_shares(last),
            "span_ms_per_step": round(span / steps / 1e3, 4),
            "busy_ms_per_step": round(busy / steps / 1e3, 4),
            "sum_ms_per_step": round(sum(e.time_range.end - e.time_range.start
                                         for e in kernels) / steps / 1e3, 4),
            "idle_ms_per_step": round((span - busy) / steps / 1e3, 4),
            "top": [{"name": name, "per_step": len(d) / steps,
                     "ms_per_step": round(sum(d) / steps / 1e3, 4),
                     "mean_us": round(sum(d) / len(d), 2)} for name, d in ranked]}


def profile_steps(core, prompt: tuple[int, ...], tokens: int, top: int = 25) -> dict:
    """One stream's decode steps, driven here (before the engine thread starts) under
    cProfile and torch's profiler: the host's time per token by function (own time) and
    the device's busy time per token, to show where a step waits on the host."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    def generate(rid: str) -> None:
        core.add(Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=tokens,
                                                      ignore_eos=True)))
        while core.has_work():
            core.step()

    generate("step-profile-warm-up")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                           if torch.cuda.is_available() else [])
    prof = cProfile.Profile()
    with profile(activities=activities) as tprof:
        t = time.perf_counter()
        prof.enable()
        generate("step-profile")
        prof.disable()
        wall = time.perf_counter() - t
    stats = pstats.Stats(prof)
    calls = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    device_us = sum(e.self_device_time_total for e in tprof.key_averages()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"tokens": tokens, "wall_ms_per_token": round(wall / tokens * 1e3, 3),
            "device_busy_ms_per_token": round(device_us / tokens / 1e3, 3),
            "host_top": [{"function": f"{Path(file).name}:{line} {fn}",
                          "calls_per_token": round(nc / tokens, 2),
                          "own_ms_per_token": round(tt / tokens * 1e3, 4),
                          "cumulative_ms_per_token": round(ct / tokens * 1e3, 4)}
                         for (file, line, fn), (_, nc, tt, ct, _) in calls]}
