"""The fairness scenario's bookkeeping on a scripted target with a hand-made timeline."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from bench_fakes import ScriptedTarget, result, timeline

from engine.bench.fairness import (
    RESULT_KEYS,
    FairnessSpec,
    LoadedRun,
    estimate_stream_tokens,
    run_fairness,
    summarize_fairness,
    summarize_slow_steps,
)
from engine.bench.prompts import PromptFactory
from engine.bench.report import compact_json
from engine.errors import EngineError

INJECT_MS, LONG_FIRST_MS = 1500, 2100


def _step(t: int) -> int:
    """Streams: 10 ms apart, 40 ms while the long prompt is being prefilled."""
    return 40 if INJECT_MS <= t < LONG_FIRST_MS else 10


def _script(stream_counts=(181, 180), short_cached=0, long_cached=0) -> dict:
    warm_times = [(256 + 11 * i) / 1000 for i in range(16)]
    return {
        "warmup": [result(0, [0.05, 0.06]), result(0, warm_times, prompt_tokens=256)],
        "short": [result(0, [0.020, 0.03, 0.04, 0.05]), result(0, [0.030, 0.04, 0.05, 0.06]),
                  result(0, [0.025, 0.03, 0.04, 0.05]),
                  result(1800, [1.860, 1.87, 1.88, 1.89], cached=short_cached)],
        "stream-0": [result(0, timeline(53, stream_counts[0], _step))],
        "stream-1": [result(0, timeline(87, stream_counts[1], _step))],
        "long": [result(INJECT_MS, [LONG_FIRST_MS / 1000], prompt_tokens=2048,
                        cached=long_cached)],
    }


SPEC = FairnessSpec(inject_after_s=0.001, short_after_s=0.001)


def _run(target, spec=SPEC) -> dict:
    factory = PromptFactory(7, target.tokenizer)
    return asyncio.run(run_fairness(target, factory, spec, progress=lambda _m: None))


def test_scenario_numbers_from_a_known_timeline():
    out = _run(ScriptedTarget(_script()))
    assert out["solo_ttft_ms"] == pytest.approx(25.0)  # median of 20, 30, 25
    assert out["loaded_short_ttft_ms"] == pytest.approx(60.0)
    assert out["fairness_ratio"] == pytest.approx(2.4)
    assert out["long_ttft_ms"] == pytest.approx(600.0)
    # Baseline: stream 0 from 93 ms (stream 1's first token is at 87) to 1493 ms, stream 1
    # from 87 to 1497 ms: 10 ms each.
    assert out["itl_baseline_ms"] == pytest.approx({"mean": 10.0, "p95": 10.0, "max": 10.0})
    # During: per stream the 10 ms interval across 1500 ms, then 15 x 40 ms to ~2100 ms.
    during = out["itl_during_injection_ms"]
    assert during["mean"] == pytest.approx((2 * 10 + 30 * 40) / 32, abs=0.01)
    assert during["p95"] == pytest.approx(40.0)
    assert during["max"] == pytest.approx(40.0)
    assert out["cache_check"] == "passed"


def test_result_keys_and_json():
    out = _run(ScriptedTarget(_script()))
    assert set(RESULT_KEYS) <= set(out)
    assert RESULT_KEYS == ("solo_ttft_ms", "loaded_short_ttft_ms", "fairness_ratio",
                           "long_ttft_ms", "itl_baseline_ms", "itl_during_injection_ms")
    for key in ("itl_baseline_ms", "itl_during_injection_ms"):
        assert set(out[key]) == {"mean", "p95", "max"}
    line = compact_json(out)
    assert "\n" not in line and " " not in line.replace("scripted", "")
    assert json.loads(line)["fairness_ratio"] == out["fairness_ratio"]


def test_requests_sent_as_the_scenario_says():
    target = ScriptedTarget(_script())
    out = _run(target, FairnessSpec(streams=2, long_tokens=2048, short_tokens=48,
                                    stream_prompt_tokens=32, inject_after_s=0.001,
                                    short_after_s=0.001))
    calls = target.calls
    assert [m for _, m in calls["short"]] == [4, 4, 4, 4]
    assert [len(p.ids) for p, _ in calls["short"]] == [48] * 4
    (long_prompt, long_max), = calls["long"]
    assert long_max == 1 and len(long_prompt.ids) == 2048
    stream_max = {m for c in ("stream-0", "stream-1") for _, m in calls[c]}
    assert stream_max == {out["stream_tokens"]}
    assert [len(calls[c][0][0].ids) for c in ("stream-0", "stream-1")] == [32, 32]
    every = [p.ids for c in calls for p, _ in calls[c]]
    assert len(set(every)) == len(every)  # every prompt is fresh
    # The stream length came from the warm-up: 256 tokens in 256 ms, ITL 11 ms.
    assert out["stream_tokens"] == estimate_stream_tokens(target_warm(), SPEC)


def target_warm():
    return _script()["warmup"][1]


def test_stream_estimate_by_hand():
    # long prefill 2048 tokens at 1000 tok/s = 2.048 s; window 1.5 + 0.3 + 2 x 2.048 + 1.0
    # + 0.256 (the warm-up's TTFT) = 7.152 s; at 11 ms per token with 25 % margin:
    # ceil(812.73) = 813.
    assert estimate_stream_tokens(target_warm(), FairnessSpec()) == 813
    assert estimate_stream_tokens(target_warm(), FairnessSpec(max_stream_tokens=500)) == 500


def test_streams_that_end_early_are_rerun_with_twice_the_tokens():
    script = _script()
    early = _script(stream_counts=(60, 60))  # they end near 0.65 s, before the injection
    for key in ("stream-0", "stream-1", "long"):
        script[key] = early[key] + script[key]
    script["short"].insert(3, result(1800, [1.86, 1.87]))
    target = ScriptedTarget(script)
    out = _run(target, FairnessSpec(stream_tokens=300, max_stream_tokens=1000,
                                    inject_after_s=0.001, short_after_s=0.001))
    assert [m for _, m in target.calls["stream-0"]] == [300, 600]
    assert out["stream_tokens"] == 600
    assert out["long_ttft_ms"] == pytest.approx(600.0)


def test_streams_too_short_even_at_the_cap_fail():
    script = _script(stream_counts=(60, 60))
    target = ScriptedTarget(script)
    with pytest.raises(EngineError, match="streams finished"):
        _run(target, FairnessSpec(stream_tokens=300, max_stream_tokens=300,
                                  inject_after_s=0.001, short_after_s=0.001))


def test_a_cache_hit_fails_loudly():
    with pytest.raises(EngineError, match="cached prompt tokens"):
        _run(ScriptedTarget(_script(short_cached=16)))
    with pytest.raises(EngineError, match="cached prompt tokens"):
        _run(ScriptedTarget(_script(long_cached=512)))
    # A token-granular cache may count the shared BOS.
    assert _run(ScriptedTarget(_script(short_cached=1), cache_slack=4))["cache_check"] \
        == "passed"


def test_unknown_cache_counts_are_said_not_zero():
    out = _run(ScriptedTarget(_script(short_cached=None)))
    assert out["cache_check"].startswith("unknown")


def test_windows_on_a_tiny_timeline():
    # Two streams; injection at 1.0 s, long first token at 1.5 s.
    s0 = result(0, [0.1, 0.3, 0.5, 0.7, 0.9, 1.2, 1.6, 1.7])
    s1 = result(0, [0.2, 0.4, 0.6, 0.8, 1.1, 1.4, 1.8])
    run = LoadedRun([s0, s1], result(1000, [1.5]), result(1300, [1.35]))
    out = summarize_fairness([result(0, [0.05])], run)
    # baseline: intervals starting at >= 0.2 and ending <= 1.0:
    # s0 (0.3,0.5) (0.5,0.7) (0.7,0.9); s1 (0.2,0.4) (0.4,0.6) (0.6,0.8) -> all 200 ms
    assert out["itl_baseline_ms"] == pytest.approx({"mean": 200.0, "p95": 200.0, "max": 200.0})
    # during: end > 1.0 and start < 1.5: s0 (0.9,1.2)=300 (1.2,1.6)=400;
    # s1 (0.8,1.1)=300 (1.1,1.4)=300 (1.4,1.8)=400
    assert out["itl_during_injection_ms"]["mean"] == pytest.approx(340.0)
    assert out["itl_during_injection_ms"]["max"] == pytest.approx(400.0)
    # p95 of [300, 300, 300, 400, 400]: rank 3.8, between the two 400s
    assert out["itl_during_injection_ms"]["p95"] == pytest.approx(400.0)
    assert out["solo_ttft_ms"] == pytest.approx(50.0)
    assert out["loaded_short_ttft_ms"] == pytest.approx(50.0)
    assert out["fairness_ratio"] == pytest.approx(1.0)
    assert out["itl_target_ms"] is None and out["itl_over_target_share"] is None
    with_target = summarize_fairness([result(0, [0.05])], run, itl_target_ms=350.0)
    assert with_target["itl_over_target_share"] == pytest.approx(2 / 5)  # the two 400s


class SlowStartTarget(ScriptedTarget):
    """Streams get their first token only after 50 ms (real time); records when."""

    def __init__(self, script, fail_stream: bool = False):
        super().__init__(script)
        self.first_token_at: list[float] = []
        self.long_sent_at: float | None = None
        self.fail_stream = fail_stream

    async def complete(self, prompt, max_tokens, *, client="bench", first_token=None):
        if client.startswith("stream-"):
            await asyncio.sleep(0.05)
            if self.fail_stream:
                raise EngineError("stream broke")
            self.first_token_at.append(time.perf_counter())
        if client == "long":
            self.long_sent_at = time.perf_counter()
        return await super().complete(prompt, max_tokens, client=client,
                                      first_token=first_token)


def test_injection_counts_from_the_streams_first_tokens():
    target = SlowStartTarget(_script())
    _run(target, FairnessSpec(inject_after_s=0.02, short_after_s=0.001))
    assert len(target.first_token_at) == 2
    assert target.long_sent_at >= max(target.first_token_at) + 0.02


def test_a_stream_failing_before_its_first_token_fails_the_run():
    with pytest.raises(EngineError, match="stream broke"):
        _run(SlowStartTarget(_script(), fail_stream=True))


class SerialTarget(ScriptedTarget):
    """Runs one request at a time (llama-cpp-python's server): the first token of a request
    comes only after the previous request has finished."""

    def __init__(self, script):
        super().__init__(script)
        self.lock = asyncio.Lock()

    async def complete(self, prompt, max_tokens, *, client="bench", first_token=None):
        async with self.lock:
            await asyncio.sleep(0.01)
            return await super().complete(prompt, max_tokens, client=client,
                                          first_token=first_token)


def test_a_serial_target_is_refused():
    with pytest.raises(EngineError, match="one after another"):
        _run(SerialTarget(_script()))


def test_streams_stopped_at_eos_are_refused():
    script = _script()
    stopped = script["stream-1"][0]
    stopped.finish_reason, stopped.completion_tokens = "stop", 40
    with pytest.raises(EngineError, match="does not honor ignore_eos"):
        _run(ScriptedTarget(script), FairnessSpec(stream_tokens=200, inject_after_s=0.001,
                                                  short_after_s=0.001))


def _slow(at_s: float, ms: float, path: str, rows: int = 2, tokens: int = 0) -> dict:
    return {"at_s": at_s, "ms": ms, "target_ms": 100.0, "decode_rows": rows,
            "prefill_tokens": tokens, "path": path}


def test_slow_steps_inside_the_loaded_run():
    """Steps the target kept over its ITL target: only those between the first stream's
    request and the last stream's last token count; the slowest first, timed from the
    injection."""
    s0 = result(0, [0.1, 0.3, 0.5, 0.7, 0.9, 1.2, 1.6, 1.7])
    s1 = result(0, [0.2, 0.4, 0.6, 0.8, 1.1, 1.4, 1.8])
    run = LoadedRun([s0, s1], result(1000, [1.5]), result(1300, [1.35]))
    steps = [_slow(-0.1, 900, "eager"), _slow(0.25, 150, "capture"),
             _slow(1.2, 300, "capture", tokens=64), _slow(1.45, 250, "eager", tokens=128),
             _slow(1.6, 120, "replay"), _slow(2.5, 800, "eager")]
    out = summarize_slow_steps(steps, run, keep=2)
    assert out["count"] == 4 and out["by_path"] == {"capture": 2, "eager": 1, "replay": 1}
    assert out["slowest"] == [
        {"at_ms": 200.0, "ms": 300.0, "path": "capture", "decode_rows": 2, "prefill_tokens": 64},
        {"at_ms": 450.0, "ms": 250.0, "path": "eager", "decode_rows": 2,
         "prefill_tokens": 128}]
    assert summarize_slow_steps([], run) == {"count": 0, "by_path": {}, "slowest": []}


class SlowStepsTarget(ScriptedTarget):
    def slow_steps(self):
        return [_slow(0.2, 500.0, "capture")]


def test_run_reports_slow_steps_when_the_target_keeps_them():
    assert "slow_steps" not in _run(ScriptedTarget(_script()))  # a target that does not say
    out = _run(SlowStepsTarget(_script()))
    assert out["slow_steps"]["count"] == 1 and out["slow_steps"]["by_path"] == {"capture": 1}
    assert out["slow_steps"]["slowest"][0]["at_ms"] == pytest.approx(200.0 - INJECT_MS)


def test_table_shows_the_target_its_overshoot_and_slow_steps():
    from engine.bench.fairness import fairness_table

    plain = _run(ScriptedTarget(_script()))
    slow = {**_run(SlowStepsTarget(_script())), "config": "kept",
            "itl_target_ms": 60.0, "itl_over_target_share": 0.052}
    lines = fairness_table([plain, slow]).splitlines()
    assert "ITL target ms" in lines[0] and "over target" in lines[0] and "slow steps" in lines[0]
    assert lines[2].split()[-3:] == ["-", "-", "-"]  # a target that keeps none of them
    assert lines[3].split()[-5:] == ["60.0", "5.2%", "1", "(1", "capture)"]
