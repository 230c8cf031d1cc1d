"""`mbufo bench SUB MODEL|--url URL`: decode, prefill, fairness, kv-quality, gguf-reject.

MODEL (a GGUF path or `default`) runs the engine in this process with the engine flags;
`--url` measures any OpenAI-compatible server instead. Progress goes to stderr; `--json`
prints one compact JSON object on the last line of stdout (fairness with `--configs`:
one line per configuration, the default flags' result last).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import shlex
import sys
import time
from typing import Any

from appliance.settings import WEIGHT_LAYOUTS
from engine.errors import InvalidRequest

KV_CHOICES = ("f16", "q8", "k8v4", "k4v8", "k4v4")


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4: {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers: {text!r}")
    return values


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a whole number: {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1: {text!r}")
    return value


def _itl_target(text: str) -> float | str | None:
    if text in ("auto", "off"):
        return None if text == "off" else "auto"
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"auto, off or milliseconds: {text!r}") from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the ITL target must be > 0 ms: {text!r}")
    return value


def _engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (in-process MODEL)")
    g.add_argument("--sessions", type=_positive, default=4, help="resident sessions (default 4; "
                   "raised to what the benchmark needs)")
    g.add_argument("-c", "--context", type=_positive, default=4096, help="tokens per session")
    g.add_argument("--prefill-chunk", type=_positive, default=512)
    g.add_argument("--mixed-batch", choices=("on", "off"), default="on")
    g.add_argument("--itl-target-ms", type=_itl_target, default="auto",
                   help="auto (default), off, or milliseconds")
    g.add_argument("--kv-quant", choices=KV_CHOICES, default="f16")
    g.add_argument("--dtype", choices=("auto", "bf16", "f32", "int8"), default="auto")
    g.add_argument("--weights", choices=WEIGHT_LAYOUTS,
                   default="auto", help="GPU weight layout (default auto: measured at load)")


def _target_args(p: argparse.ArgumentParser, peers: bool = False) -> None:
    p.add_argument("model", nargs="?", help="GGUF path or 'default' (in-process engine)")
    p.add_argument("--url", help="an OpenAI-compatible server instead of MODEL")
    p.add_argument("--synthetic", metavar="NAME:QUANT",
                   help="instead of MODEL: a random-weight GGUF with a real model's shapes, "
                        "e.g. llama-3.1-8b:Q4_K_M (needs --vocab)")
    p.add_argument("--vocab", help="a GGUF whose tokenizer the synthetic model copies "
                   "(e.g. llama.cpp's models/ggml-vocab-llama-bpe.gguf)")
    p.add_argument("--api-key", help="bearer key for --url / --peer-url")
    p.add_argument("--model-name", help="`model` field for --url (default: the first of "
                   "/v1/models)")
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: random)")
    p.add_argument("--json", action="store_true", help="one JSON object on the last line")
    if peers:
        p.add_argument("--peer", choices=("llama-cpp",),
                       help="also measure llama-cpp-python in this process on MODEL")
        p.add_argument("--peer-url", help="also measure this OpenAI-compatible server")
    _engine_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks against the engine or an --url server")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")

    p = bsub.add_parser("decode", help="tok/s and ITL at several concurrency levels")
    _target_args(p, peers=True)
    p.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16])
    p.add_argument("--tokens", type=_positive, default=64, help="tokens per request (ignore_eos)")
    p.add_argument("--prompt-tokens", type=_positive, default=24)
    p.set_defaults(handler=cmd_decode)

    p = bsub.add_parser("prefill", help="prompt tok/s by length (fresh prompts, max_tokens 1)")
    _target_args(p, peers=True)
    p.add_argument("--lengths", type=_int_list, default=[128, 512, 2048])
    p.add_argument("--repeats", type=_positive, default=1, help="fresh prompts per length (median)")
    p.set_defaults(handler=cmd_prefill)

    p = bsub.add_parser("fairness", help="N streams, a long prompt injected, then a short one")
    _target_args(p)
    p.add_argument("--peer", choices=("llama-cpp-server",), help="first run the scenario on "
                   "`python -m llama_cpp.server` started on MODEL's file (serial: requests queue)")
    p.add_argument("--streams", type=_positive, default=2)
    p.add_argument("--scenario", choices=("A", "B"), default="A",
                   help="A: long prompt 2048 tokens, B: 4096")
    p.add_argument("--long-tokens", type=_positive, default=None, help="overrides --scenario")
    p.add_argument("--short-tokens", type=_positive, default=48, help="about 40 words")
    p.add_argument("--stream-tokens", type=_positive, default=None,
                   help="tokens per stream (default: estimated to outlast the injection)")
    p.add_argument("--configs", default=None, help="several engine configurations, ';'-"
                   "separated flag sets, e.g. --configs='--itl-target-ms off;--mixed-batch "
                   "off' (the command's own flags run last)")
    p.set_defaults(handler=cmd_fairness)

    p = bsub.add_parser("clients", help="one heavy client and light ones: light clients' "
                        "TTFT under load vs solo")
    _target_args(p)
    p.add_argument("--heavy-requests", type=_positive, default=12)
    p.add_argument("--light-clients", type=_positive, default=4)
    p.add_argument("--prompt-tokens", type=_positive, default=128)
    p.add_argument("--tokens", type=_positive, default=16, help="light requests' max_tokens")
    p.add_argument("--heavy-tokens", type=_positive, default=64)
    p.add_argument("--light-gap-s", type=float, help="seconds between light arrivals "
                   "(default 2x the solo TTFT; 0: all at once)")
    p.set_defaults(handler=cmd_clients)

    p = bsub.add_parser("kv-quality", help="KL and argmax agreement of each KV format")
    p.add_argument("model", help="GGUF path or 'default'")
    p.add_argument("--formats", default=",".join(KV_CHOICES))
    p.add_argument("--steps", type=_positive, default=98)
    p.add_argument("--context-tokens", type=_positive, default=400)
    p.add_argument("--teacher", choices=("prefill", "decode"), default="prefill",
                   help="feed the 98 tokens as one chunk (default) or one per forward")
    p.add_argument("--dtype", choices=("auto", "bf16", "f32", "int8"), default="auto")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_kv_quality)

    p = bsub.add_parser("gguf-reject", help="time and memory to reject malformed GGUF files")
    p.add_argument("--repeats", type=_positive, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_gguf_reject)


# ---- targets ---------------------------------------------------------------------------------
def engine_options(args: argparse.Namespace, *, min_sessions: int = 1, min_context: int = 1):
    from engine.build import EngineOptions

    sessions = max(args.sessions, min_sessions)
    context = max(args.context, min_context)
    if args.model is not None and (sessions != args.sessions or context != args.context):
        _progress(f"engine: {sessions} sessions x {context} tokens (what the benchmark needs)")
    return EngineOptions(sessions=sessions, context=context, prefill_chunk=args.prefill_chunk,
                         mixed_batch=args.mixed_batch == "on",
                         itl_target_ms=args.itl_target_ms, kv_quant=args.kv_quant,
                         dtype=args.dtype, weights=getattr(args, "weights", "auto"))


def _check_source(args: argparse.Namespace) -> None:
    if getattr(args, "synthetic", None):
        from pathlib import Path

        from engine.synthetic import ensure_synthetic

        if args.model is not None or not args.vocab:
            raise InvalidRequest("--synthetic replaces MODEL and needs --vocab VOCAB.gguf")
        try:
            args.model = str(ensure_synthetic(args.synthetic, args.vocab,
                                              Path.home() / ".cache" / "mbufo" / "synthetic"))
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
    if (args.model is None) == (args.url is None):
        raise InvalidRequest("give either MODEL (in-process) or --url URL, not both")
    if getattr(args, "peer", None) and args.model is None:
        raise InvalidRequest(f"--peer {args.peer} runs on MODEL's file: give MODEL")


async def _open_targets(args: argparse.Namespace, options: Any, loaded: Any = None) -> list:
    from engine.bench.target import HttpTarget, InProcessTarget, LlamaCppTarget

    if args.url:
        targets: list = [HttpTarget(args.url, model=args.model_name, api_key=args.api_key)]
    else:
        if loaded is None:
            _progress(f"loading {args.model} ...")
        targets = [await asyncio.to_thread(InProcessTarget.from_model, args.model, options,
                                           loaded)]
    if getattr(args, "peer", None) == "llama-cpp":
        import torch

        from engine.loader import resolve_model_path

        targets.append(LlamaCppTarget(resolve_model_path(args.model), n_ctx=options.context,
                                      n_threads=torch.get_num_threads(),
                                      tokenizer=targets[0].tokenizer))
    if getattr(args, "peer_url", None):
        targets.append(HttpTarget(args.peer_url, api_key=args.api_key, name="peer"))
    return targets


def _seed(args: argparse.Namespace) -> int:
    return args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)


def _emit(obj: dict[str, Any], as_json: bool, table: str) -> None:
    from appliance.cli.main import emit_json

    if as_json:
        emit_json(obj)
    else:
        print(table)


# ---- commands --------------------------------------------------------------------------------
def cmd_decode(args: argparse.Namespace) -> int:
    from engine.bench.bound import bound_line, loaded_bound, share_of_bound
    from engine.bench.decode import decode_table, run_decode
    from engine.bench.prompts import PromptFactory

    _check_source(args)
    seed = _seed(args)
    options = engine_options(args, min_sessions=max(args.concurrency),
                             min_context=args.prompt_tokens + args.tokens + 1)

    async def run() -> dict[str, Any]:
        targets = await _open_targets(args, options)
        results = {}
        try:
            for target in targets:
                factory = await PromptFactory.for_target(target, seed)
                levels = [1] if target.is_serial else args.concurrency  # one sequence at a time
                results[target.name] = await run_decode(target, factory, levels, args.tokens,
                                                        args.prompt_tokens, _progress)
                one = next((lv for lv in results[target.name] if lv["concurrency"] == 1), None)
                loaded = getattr(getattr(target, "engine", None), "loaded", None)
                if one is not None and loaded is not None:  # the in-process engine
                    bounds[target.name] = await asyncio.to_thread(
                        loaded_bound, loaded, args.prompt_tokens + args.tokens, options.kv_quant)
                    bounds[target.name]["one_stream_pct"] = share_of_bound(
                        one["per_session_tok_s"], bounds[target.name])
        finally:
            for target in targets:
                await target.aclose()
        return {"bench": "decode", "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
                "seed": seed, "targets": [t.describe() for t in targets], "results": results,
                "bounds": bounds}

    bounds: dict[str, Any] = {}
    out = asyncio.run(run())
    table = decode_table(out["results"])
    for name, bound in bounds.items():  # one stream's decode rate against its bytes' bound
        one = next(lv for lv in out["results"][name] if lv["concurrency"] == 1)
        table += f"\n{name}: {bound_line(one['per_session_tok_s'], bound)}"
    _emit(out, args.json, table)
    return 0


def cmd_prefill(args: argparse.Namespace) -> int:
    from engine.bench.prefill import prefill_table, run_prefill
    from engine.bench.prompts import PromptFactory

    _check_source(args)
    seed = _seed(args)
    options = engine_options(args, min_context=max(args.lengths) + 1)

    async def run() -> dict[str, Any]:
        targets = await _open_targets(args, options)
        results = {}
        try:
            for target in targets:
                factory = await PromptFactory.for_target(target, seed)
                results[target.name] = await run_prefill(target, factory, args.lengths,
                                                         args.repeats, _progress)
        finally:
            for target in targets:
                await target.aclose()
        return {"bench": "prefill", "seed": seed, "targets": [t.describe() for t in targets],
                "results": results}

    out = asyncio.run(run())
    _emit(out, args.json, prefill_table(out["results"]))
    return 0


def cmd_clients(args: argparse.Namespace) -> int:
    from engine.bench.clients import run_clients
    from engine.bench.prompts import PromptFactory

    _check_source(args)
    if args.url:
        raise InvalidRequest("bench clients runs in-process (clients are ids there); over "
                             "HTTP each client needs its own API key")
    seed = _seed(args)
    options = engine_options(args, min_context=args.prompt_tokens + args.heavy_tokens + 8)

    async def run() -> dict[str, Any]:
        (target,) = await _open_targets(args, options)
        try:
            factory = await PromptFactory.for_target(target, seed)
            result = await run_clients(target, factory, heavy_requests=args.heavy_requests,
                                       light_clients=args.light_clients,
                                       prompt_tokens=args.prompt_tokens,
                                       max_tokens=args.tokens, heavy_tokens=args.heavy_tokens,
                                       light_gap_s=args.light_gap_s, progress=_progress)
        finally:
            await target.aclose()
        return {"bench": "clients", "seed": seed, "target": target.describe(), **result}

    out = asyncio.run(run())
    table = (f"light TTFT solo {out['solo_light_ttft_ms']:.0f} ms, under a heavy client "
             f"{out['loaded_light_ttft_ms']:.0f} ms: x{out['light_ttft_ratio']:.2f}")
    itl = out["heavy_itl_during_light_ms"]
    if itl["max"] is not None:
        table += (f"; the heavy streams' ITL meanwhile mean {itl['mean']:.1f} ms, max "
                  f"{itl['max']:.1f} ms")
    if "slow_steps" in out:
        table += f"; steps over the ITL target: {out['slow_steps']['count']}"
    _emit(out, args.json, table)
    return 0


def fairness_configs(args: argparse.Namespace) -> list[tuple[str, argparse.Namespace]]:
    """`--configs` -> (label, flags) per configuration; the command's own flags last."""
    if not args.configs:
        return [("default", args)]
    if args.url:
        raise InvalidRequest("--configs changes engine flags: it needs an in-process MODEL")
    flags = argparse.ArgumentParser(prog="--configs", add_help=False)
    _engine_args(flags)
    others = []
    for spec in (s.strip() for s in args.configs.split(";")):
        if spec and spec != "default":
            others.append((spec, flags.parse_args(shlex.split(spec),
                                                  namespace=copy.copy(args))))
    return [*others, ("default", args)]


def cmd_fairness(args: argparse.Namespace) -> int:
    from engine.bench.fairness import SCENARIO_LONG_TOKENS, fairness_table

    _check_source(args)
    seed = _seed(args)
    long_tokens = args.long_tokens or SCENARIO_LONG_TOKENS[args.scenario]
    loaded: dict[str, Any] = {}
    rows = []
    peers = [(args.peer, args)] if args.peer else []  # first: ours stays the last line
    for label, cargs in peers + fairness_configs(args):
        out = asyncio.run(_fairness_one(cargs, label, long_tokens, seed, loaded))
        rows.append(out)
        if args.json:
            _emit(out, True, "")
    if not args.json:
        print(fairness_table(rows))
    return 0


async def _fairness_one(args: argparse.Namespace, label: str, long_tokens: int, seed: int,
                        loaded: dict[str, Any]) -> dict[str, Any]:
    from engine.bench.fairness import FairnessSpec, run_fairness
    from engine.bench.prompts import PromptFactory

    options = engine_options(args, min_sessions=args.streams + 2, min_context=long_tokens + 16)
    key = (options.dtype, options.weights)  # one load for the configs that share them
    startup: dict[str, Any] = {"load_s": None}  # None: this configuration reused a load
    if args.model is not None and key not in loaded:
        from engine.build import load_for

        # load_for, not engine.loader.load: the options' device (the GPU when there is one)
        # and weight layout, as build_engine would load them
        start = time.perf_counter()
        loaded[key] = await asyncio.to_thread(load_for, args.model, options)
        startup["load_s"] = round(time.perf_counter() - start, 2)
    _progress(f"fairness: configuration {label}")
    start = time.perf_counter()
    if label == getattr(args, "peer", None):  # on MODEL's file, with the engine's threads
        from engine.bench.peer_server import open_llama_cpp_server

        target = await open_llama_cpp_server(loaded[key].path, n_ctx=options.context)
    else:
        target = (await _open_targets(args, options, loaded.get(key)))[0]
    # build_s: the engine's build (kernels, tile tune, warm-up's graph captures) or the
    # peer's start; graphs: what the build captured, before any request
    startup["build_s"] = round(time.perf_counter() - start, 2)
    startup["graphs"] = _graphs_held(target)
    try:
        spec = FairnessSpec(streams=args.streams, long_tokens=long_tokens,
                            short_tokens=args.short_tokens, stream_tokens=args.stream_tokens,
                            max_stream_tokens=options.context - 33)
        factory = await PromptFactory.for_target(target, seed)
        result = await run_fairness(target, factory, spec, _progress)
    finally:
        await target.aclose()
    return {"config": label, "scenario": args.scenario if not args.long_tokens else None,
            "seed": seed, "startup": startup, **result}


def _graphs_held(target: Any) -> int | None:
    """The graphs an in-process engine's runner holds; None for other targets."""
    runner = getattr(getattr(getattr(target, "engine", None), "core", None), "runner", None)
    return getattr(runner, "num_graphs", None)


def cmd_kv_quality(args: argparse.Namespace) -> int:
    from engine.bench.kv_quality import kv_quality_table, run_kv_quality

    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = sorted(set(formats) - set(KV_CHOICES))
    if unknown:
        raise InvalidRequest(f"unknown KV formats {unknown}; choose from {list(KV_CHOICES)}")
    out = run_kv_quality(args.model, formats=formats, steps=args.steps,
                         context_tokens=args.context_tokens, teacher=args.teacher,
                         dtype=args.dtype, progress=_progress)
    _emit(out, args.json, kv_quality_table(out))
    return 0


def cmd_gguf_reject(args: argparse.Namespace) -> int:
    from engine.bench.gguf_reject import run_gguf_reject_bench

    out = run_gguf_reject_bench(repeats=args.repeats)
    table = "\n".join(f"{k:22} {v}" for k, v in out.items())
    _emit({"bench": "gguf-reject", **out}, args.json, table)
    return 0
