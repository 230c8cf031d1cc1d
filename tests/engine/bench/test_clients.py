"""`bench clients`: light clients arrive a gap apart under a heavy client; the figure is
their median TTFT over their solo median."""

from __future__ import annotations

import asyncio
import time

from bench_fakes import ScriptedTarget, parse_cli, result

from engine.bench.clients import run_clients
from engine.bench.prompts import PromptFactory


class TimedTarget(ScriptedTarget):
    """Scripted results, plus the wall time of each light call."""

    def __init__(self, script) -> None:
        super().__init__(script)
        self.sent: dict[str, float] = {}

    async def complete(self, prompt, max_tokens, *, client="bench", first_token=None):
        self.sent.setdefault(client + ("#2" if client in self.sent else ""), time.monotonic())
        return await super().complete(prompt, max_tokens, client=client,
                                      first_token=first_token)


def _script(solo_ms: list[int], loaded_ms: list[int], heavy: int) -> dict:
    script = {"warmup": [result(0, [0.01])], "heavy": [result(0, [0.5, 0.6])] * heavy}
    for i, (a, b) in enumerate(zip(solo_ms, loaded_ms, strict=True)):
        script[f"light{i}"] = [result(0, [a / 1000]), result(0, [b / 1000])]
    return script


def test_ratio_is_the_loaded_median_over_the_solo_median_and_lights_arrive_apart():
    target = TimedTarget(_script([100, 120, 80, 110], [150, 400, 210, 190], heavy=3))
    factory = asyncio.run(PromptFactory.for_target(target, 5))
    out = asyncio.run(run_clients(target, factory, heavy_requests=3, light_clients=4,
                                  prompt_tokens=32, light_gap_s=0.05))
    assert out["solo_light_ttft_ms"] == 105.0  # median of 100, 120, 80, 110
    assert out["loaded_light_ttft_ms"] == 200.0  # median of 150, 400, 210, 190
    assert out["light_ttft_ratio"] == round(200 / 105, 3)
    assert out["light_gap_s"] == 0.05
    loaded = [target.sent[f"light{i}#2"] for i in range(4)]
    gaps = [b - a for a, b in zip(loaded, loaded[1:], strict=False)]
    assert all(g >= 0.045 for g in gaps), gaps
    assert len(target.calls["heavy"]) == 3


def test_default_gap_is_twice_the_solo_median():
    target = TimedTarget(_script([10, 10], [12, 14], heavy=1))
    factory = asyncio.run(PromptFactory.for_target(target, 5))
    out = asyncio.run(run_clients(target, factory, heavy_requests=1, light_clients=2,
                                  prompt_tokens=32))
    assert out["light_gap_s"] == 0.02


def test_cli_flag():
    args = parse_cli(["bench", "clients", "default", "--light-gap-s", "0"])
    assert args.light_gap_s == 0.0


class KeepsSlowSteps(TimedTarget):
    def slow_steps(self):
        return [{"path": "eager"}, {"path": "capture"}, {"path": "eager"}]


def test_heavy_streams_gaps_while_the_lights_arrive_and_slow_steps():
    """Only the heavy streams' intervals that overlap the lights' window (first light sent
    to last light's first token) count; slow steps come from a target that keeps them."""
    script = _script([10, 10], [100, 200], heavy=0)
    script["heavy"] = [result(0, [0.1, 0.15, 0.3, 0.7])] * 2
    out = asyncio.run(run_clients(KeepsSlowSteps(script), asyncio.run(
        PromptFactory.for_target(TimedTarget(dict(script)), 5)), heavy_requests=2,
        light_clients=2, prompt_tokens=32, light_gap_s=0.0))
    # lights sent at 0, first tokens by 0.2 s: (0.1, 0.15) and (0.15, 0.3) overlap it
    assert out["heavy_itl_during_light_ms"] == {"mean": 100.0, "p95": 150.0, "max": 150.0}
    assert out["slow_steps"] == {"count": 3, "by_path": {"eager": 2, "capture": 1}}
    plain = _script([10, 10], [100, 200], heavy=1)
    assert "slow_steps" not in asyncio.run(run_clients(
        TimedTarget(plain), asyncio.run(PromptFactory.for_target(TimedTarget(dict(plain)), 5)),
        heavy_requests=1, light_clients=2, prompt_tokens=32, light_gap_s=0.0))
