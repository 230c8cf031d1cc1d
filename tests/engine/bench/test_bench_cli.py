"""`mbufo bench` wiring: flags, --configs, one JSON line per configuration (default last)."""

from __future__ import annotations

import argparse
import json
import types

import pytest
from bench_fakes import parse_cli

from appliance.cli import bench_command
from engine.errors import InvalidRequest


def parse(argv: list[str]) -> argparse.Namespace:
    return parse_cli(argv)


def test_engine_flags_and_lists():
    args = parse(["bench", "decode", "default", "--concurrency", "1,2,4", "--tokens", "8",
                  "--mixed-batch", "off", "--itl-target-ms", "off", "-c", "2048",
                  "--kv-quant", "q8", "--peer", "llama-cpp"])
    assert args.concurrency == [1, 2, 4] and args.tokens == 8 and args.peer == "llama-cpp"
    opts = bench_command.engine_options(args, min_sessions=4, min_context=100)
    assert (opts.sessions, opts.context, opts.mixed_batch, opts.itl_target_ms,
            opts.kv_quant) == (4, 2048, False, None, "q8")
    opts = bench_command.engine_options(parse(["bench", "prefill", "default", "--sessions",
                                               "2", "--itl-target-ms", "25"]),
                                        min_sessions=16, min_context=5000)
    assert (opts.sessions, opts.context, opts.itl_target_ms) == (16, 5000, 25.0)
    assert opts.weights == "auto"
    opts = bench_command.engine_options(parse(["bench", "decode", "default", "--weights",
                                               "hybrid"]))
    assert opts.weights == "hybrid"
    with pytest.raises(SystemExit):
        parse(["bench", "decode", "default", "--weights", "q4"])
    with pytest.raises(SystemExit):
        parse(["bench", "decode", "default", "--concurrency", "0,2"])
    with pytest.raises(SystemExit):
        parse(["bench", "decode", "default", "--itl-target-ms", "-3"])
    for flag in ("--tokens", "--sessions", "--prompt-tokens", "--context"):
        with pytest.raises(SystemExit):
            parse(["bench", "decode", "default", flag, "0"])


def test_model_or_url():
    with pytest.raises(InvalidRequest, match="either MODEL"):
        bench_command._check_source(parse(["bench", "decode", "default", "--url", "http://x"]))
    with pytest.raises(InvalidRequest, match="either MODEL"):
        bench_command._check_source(parse(["bench", "decode"]))
    with pytest.raises(InvalidRequest, match="MODEL's file"):
        bench_command._check_source(parse(["bench", "decode", "--url", "http://x",
                                           "--peer", "llama-cpp"]))


def test_configs_run_default_last():
    args = parse(["bench", "fairness", "default", "--prefill-chunk", "256", "--configs",
                  "default; --itl-target-ms off; --mixed-batch off --prefill-chunk 128"])
    configs = bench_command.fairness_configs(args)
    assert [label for label, _ in configs] == [
        "--itl-target-ms off", "--mixed-batch off --prefill-chunk 128", "default"]
    first, second, default = (c for _, c in configs)
    assert first.itl_target_ms is None and first.prefill_chunk == 256
    assert second.mixed_batch == "off" and second.prefill_chunk == 128
    assert second.itl_target_ms == "auto"
    assert default is args and default.mixed_batch == "on"
    with pytest.raises(InvalidRequest, match="in-process"):
        bench_command.fairness_configs(parse(["bench", "fairness", "--url", "http://x",
                                              "--configs", "--mixed-batch off"]))


def test_fairness_prints_one_json_line_per_config(monkeypatch, capsys):
    async def fake_one(args, label, long_tokens, seed, loaded):
        return {"config": label, "mixed": args.mixed_batch, "long": long_tokens, "seed": seed}

    monkeypatch.setattr(bench_command, "_fairness_one", fake_one)
    args = parse(["bench", "fairness", "default", "--json", "--scenario", "B", "--seed", "9",
                  "--configs", "default;--mixed-batch off;--itl-target-ms off"])
    assert args.handler(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    objs = [json.loads(line) for line in lines]
    assert [o["config"] for o in objs] == ["--mixed-batch off", "--itl-target-ms off",
                                           "default"]
    assert objs[0]["mixed"] == "off" and objs[-1]["mixed"] == "on"
    assert {o["long"] for o in objs} == {4096} and {o["seed"] for o in objs} == {9}
    assert lines == [json.dumps(o, separators=(",", ":")) for o in objs]  # compact


def test_fairness_loads_the_model_as_the_engine_would(monkeypatch, capsys):
    """The configs' shared load goes through engine.build.load_for with each config's
    options (device auto: the GPU where there is one; the weight layout), once per dtype
    and layout, and the loaded model reaches the engine. Each line reports its startup:
    the load's seconds (None where a load was reused), the build's, the graphs held."""
    import engine.bench.fairness as fairness
    import engine.build
    from engine.bench.prompts import PromptFactory

    loads, opened = [], []

    def fake_load_for(model, options):
        loads.append((model, options.device, options.weights, options.context))
        return f"loaded {options.weights}"

    class Target:
        def __init__(self, graphs):
            runner = types.SimpleNamespace(num_graphs=graphs)
            self.engine = types.SimpleNamespace(core=types.SimpleNamespace(runner=runner))

        async def aclose(self):
            pass

    async def fake_targets(args, options, loaded=None):
        opened.append(loaded)
        return [Target(len(opened))]

    async def fake_factory(target, seed):
        return None

    async def fake_run(target, factory, spec, progress):
        return {"streams": spec.streams}

    monkeypatch.setattr(engine.build, "load_for", fake_load_for)
    monkeypatch.setattr(bench_command, "_open_targets", fake_targets)
    monkeypatch.setattr(PromptFactory, "for_target", staticmethod(fake_factory))
    monkeypatch.setattr(fairness, "run_fairness", fake_run)
    args = parse(["bench", "fairness", "m.gguf", "--json", "--streams", "3", "--weights", "q8",
                  "--long-tokens", "5000", "--configs", "--mixed-batch off;--weights bf16"])
    assert args.handler(args) == 0
    assert loads == [("m.gguf", "auto", "q8", 5016), ("m.gguf", "auto", "bf16", 5016)]
    assert opened == ["loaded q8", "loaded bf16", "loaded q8"]  # --mixed-batch off, bf16, default
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    startups = [o["startup"] for o in lines]
    assert [s["graphs"] for s in startups] == [1, 2, 3]
    assert [s["load_s"] is None for s in startups] == [False, False, True]
    assert all(s["load_s"] is None or s["load_s"] >= 0 for s in startups)
    assert all(s["build_s"] >= 0 for s in startups)


def test_gguf_reject_is_wired(monkeypatch, capsys):
    import engine.bench.gguf_reject as reject

    monkeypatch.setattr(reject, "run_gguf_reject_bench",
                        lambda repeats: {"num_cases": 3, "repeats": repeats})
    args = parse(["bench", "gguf-reject", "--repeats", "2", "--json"])
    assert args.handler(args) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == {"bench": "gguf-reject", "num_cases": 3, "repeats": 2}
