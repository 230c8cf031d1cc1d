"""Engine decode/prefill on a GPU with a synthetic model (real shapes, random weights).

Run on the device machine (see bench/RESULTS.md for the command):
    python bench/gpu/engine_bench.py --synthetic llama-3.1-8b:Q4_K_M --vocab VOCAB.gguf
One invocation measures several variants (`--variants`, default: GGML blocks and dense
bf16 weights, each with and without CUDA graphs; `+itloff` turns the ITL target off,
`+noahead` the look-ahead decode steps, `+notune` q8's load-time tile tuning, `+dN`
gives the hybrid layout's threshold (N rows) instead of measuring it; `+sampled`
decodes at temperature 0.8, top-p 0.95 instead of greedily; `+padN` launches N empty
kernels after each fused norm, bench/gpu/pad_kernels.py: the cost of one launch in the
step's chain).
Per variant: the forward step alone (runner.forward timed with a device sync, decode
batches of each concurrency at `--forward-context` keys a row, 256 by default, or the
context if shorter: more than the decode streams' own), engine decode at each concurrency
(fixed output length, ignore_eos; `--consumers asyncio` reads the streams as the server
does, one event loop, instead of a thread each) with a per-step breakdown (schedule +
batch building, forward launch, sampling including the wait for the device) and the ITL
policy's state afterwards, prefill of each prompt length, optionally a profile of one eager
decode step (kernel count, top kernels by device time), and the Triton kernels built in each
phase (those built while measured stalled a step: shapes the load-time warm-up missed). A
variant or a measurement that fails is recorded with its error and the run goes on; the JSON
($OUT/engine_bench.json or --out) is rewritten after every variant, so a run cut short
keeps what it measured. The step's timings and profiles are bench/gpu/engine_profile.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]

import torch  # noqa: E402
from engine_profile import forward_ms, profile_decode, profile_graph, profile_steps  # noqa: E402
from pad_kernels import pad_count, padded_norms  # noqa: E402
from provenance import commit_id  # noqa: E402

from engine.bench.bound import (  # noqa: E402
    bound_line,
    copy_rate_gb_s,
    decode_bound,
    share_of_bound,
)
from engine.build import EngineOptions, build_core, load_for  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.gguf import ModelFile  # noqa: E402
from engine.kv.formats import KV_QUANT_CHOICES  # noqa: E402
from engine.models.registry import read_config  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler.request import Request  # noqa: E402
from engine.synthetic import ensure_synthetic  # noqa: E402

VARIANTS = "ggml+graphs,ggml,bf16+graphs,bf16"


def run_batch(engine: Engine, prompts: list[tuple[int, ...]], max_tokens: int,
              temperature: float = 0.0, consumers: str = "threads") -> dict:
    """Every prompt a stream at once; `consumers`: "threads" (one consuming thread per
    stream, Engine.stream) or "asyncio" (every stream a task on one event loop through
    Engine.submit, as the server consumes them)."""
    params = SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0,
                            seed=0, max_tokens=max_tokens, ignore_eos=True)
    times: dict[int, list[float]] = {}
    start = time.perf_counter()

    if consumers == "asyncio":
        async def consume_all() -> None:
            async def one(i: int) -> None:
                stamps = []
                async for chunk in engine.submit(Request(f"r{i}-{start}", prompts[i],
                                                         params)):
                    stamps.extend([time.perf_counter()] * len(chunk.token_ids))
                times[i] = stamps

            await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(len(prompts)))),
                                   timeout=300)

        asyncio.run(consume_all())
    elif consumers == "threads":
        def one(i: int) -> None:
            stamps = []
            for chunk in engine.stream(Request(f"r{i}-{start}", prompts[i], params),
                                       timeout=300):
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
            times[i] = stamps

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        raise ValueError(f"consumers: threads or asyncio, not {consumers!r}")
    if len(times) != len(prompts):
        raise RuntimeError(f"{len(prompts) - len(times)} streams failed (engine error: "
                           f"{engine.error!r})")
    first = [s[0] for s in times.values()]
    last = max(s[-1] for s in times.values())
    decoded = sum(len(s) - 1 for s in times.values())
    steady_from = max(first)  # every stream is decoding from here on
    in_steady = sum(sum(1 for x in s if x > steady_from) for s in times.values())
    return {"concurrency": len(prompts),
            "ttft_ms_median": statistics.median((f - start) * 1e3 for f in first),
            "total_tok_s": decoded / (last - min(first)),
            "steady_tok_s": in_steady / (last - steady_from) if last > steady_from else None}


class StepTimer:
    """Wraps a core's runner.forward and sampler.sample (instance attributes) and step()."""

    def __init__(self, core) -> None:
        self.acc: dict[str, float] = {"step": 0.0, "forward": 0.0, "sample": 0.0}
        self.steps = 0
        for obj, name, key in ((core, "step", "step"), (core.runner, "forward", "forward"),
                               (core.sampler, "sample", "sample")):
            setattr(obj, name, self._timed(getattr(obj, name), key))

    def _timed(self, fn, key: str):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.acc[key] += time.perf_counter() - t
                self.steps += key == "step"
        return wrapper

    def reset(self) -> None:
        self.acc = dict.fromkeys(self.acc, 0.0)
        self.steps = 0

    def per_step_ms(self) -> dict[str, float]:
        n = max(1, self.steps)
        out = {k: round(v / n * 1e3, 3) for k, v in self.acc.items()}
        out["other"] = round(out["step"] - out["forward"] - out["sample"], 3)
        out["steps"] = self.steps
        return out



def scheduler_state(core) -> dict:
    """The ITL policy's state after a run: target, margin, first-token bursts so far, and
    the recent mixed steps it judges the margin by."""
    sched = core.scheduler
    target = sched.itl.target_s
    return {"itl_target_ms": None if target is None else round(target * 1e3, 2),
            "itl_margin": round(sched.itl.margin(), 3),
            "first_token_bursts": sched.packer.burst.num_bursts,
            "stalls_left_out": sched.itl.num_stalls,
            "max_recent_prefill": sched.itl.max_recent_prefill(),
            # what the margin reads: (decode rows, prefill tokens, measured ms, modelled ms)
            "recent_mixed_steps": [(r, n, round(t * 1e3, 2), round(m * 1e3, 2))
                                   for r, n, t, m in sched.itl.recent_steps()]}


SAVE: list = []  # main's callback that rewrites the JSON file


class BuildLog:
    """Triton kernel builds (in-process cache misses: a build, or a load from Triton's disk
    cache) by phase, through Triton's JIT hooks: a build while serving stalls the step that
    needs it, so builds after the engine's load-time warm-up name the shapes it missed."""

    def __init__(self) -> None:
        self.phase, self.t0 = "load", time.perf_counter()
        self.builds: dict[str, list[dict]] = {}
        self._started: dict[int, float] = {}
        try:
            from triton import knobs
        except ImportError:  # the CPU torch build brings no Triton: nothing is built
            return
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, *, key, **_: object) -> None:
        self._started[id(key)] = time.perf_counter()

    def _after(self, *, key, repr: str, fn, compile: dict, **_: object) -> None:
        now = time.perf_counter()
        started = self._started.pop(id(key), now)
        self.builds.setdefault(self.phase, []).append(
            {"kernel": getattr(fn, "name", str(fn)), "s": round(now - started, 3),
             "at_s": round(now - self.t0, 2), "spec": self.specialization(fn, compile, repr)})

    @staticmethod
    def specialization(fn, compile: dict, repr: str) -> str:
        """What sets this build apart: each runtime argument's class (an int specialized
        to 1, divisible by 16 ('/16'), or neither; a pointer's 16-byte alignment) and the
        constexpr values."""
        try:
            names = list(compile["signature"])
            attrs = compile["configs"][0]
            declared = set(fn.jit_function.constexprs)
            parts = []
            for i, name in enumerate(names):
                value = compile["constants"].get((i,), compile["constants"].get(name))
                if i in declared:
                    parts.append(f"{name}={value}")
                elif compile["signature"][name] == "constexpr":
                    parts.append(f"{name}=={value}")  # an int specialized to its value
                else:
                    div = any(a[0] == "tt.divisibility" for a in attrs.get((i,), []))
                    parts.append(f"{name}{'/16' if div else ''}")
            return " ".join(parts)
        except Exception:  # the hook's arguments differ in another Triton version
            return repr[:400]

    def start(self, phase: str) -> None:
        self.phase = phase

    def summary(self) -> dict:
        """Per phase: the count, the seconds they took, and (past the load) each build."""
        return {phase: {"count": len(rows), "s": round(sum(r["s"] for r in rows), 2),
                        **({} if phase == "load" else {"builds": rows})}
                for phase, rows in self.builds.items()}


def attempt(record: dict, key: str, fn, *args):
    """fn(*args) stored under record[key]; an exception is recorded there instead. The
    JSON is rewritten after each figure."""
    try:
        record[key] = fn(*args)
    except Exception as exc:  # one failing figure must not lose the others
        record[key] = {"error": repr(exc), "traceback": traceback.format_exc(limit=8)}
        print(f"  {key}: FAILED {exc!r}", flush=True)
    for save in SAVE:
        save()
    return record[key]


def run_variant(path: Path, name: str, args, levels: list[int], lengths: list[int],
                out: dict) -> None:
    """Fills `out` as it goes (a failure keeps what was measured before it)."""
    parts = name.split("+")
    weights, graphs = parts[0], "graphs" in parts
    # hybrid's threshold given (`+d32`) instead of measured at load
    dense_rows = next((int(p[1:]) for p in parts[1:] if p[:1] == "d" and p[1:].isdigit()),
                      None)
    context = max(*lengths, args.prompt) + args.tokens + 64
    opts = EngineOptions(sessions=max(levels), context=context, prefill_chunk=512,
                         device=args.device, max_pending_per_client=None, cuda_graphs=graphs,
                         weights=weights, itl_target_ms=None if "itloff" in parts else "auto",
                         look_ahead="noahead" not in parts, tune_tiles="notune" not in parts,
                         dense_rows=dense_rows, kv_quant=args.kv_quant)
    out.update({"weights": weights, "cuda_graphs": graphs, "look_ahead": "noahead" not in parts,
                "tune_tiles": "notune" not in parts, "pad_kernels": pad_count(name)})
    t0 = time.perf_counter()
    builds = BuildLog()
    loaded = load_for(str(path), opts)
    core = build_core(loaded, opts)
    out["load_s"] = round(time.perf_counter() - t0, 1)
    builds.start("after_load")  # the bench's own forward, profile and capture figures
    if loaded.tile_choice is not None:  # q8: its matrix-unit tiles were timed
        out["tile_choice"] = loaded.tile_choice.as_dict()
        print(f"[{name}] q8 tiles: {out['tile_choice']['tiles']}", flush=True)
    if loaded.layout_choice is not None:  # auto or hybrid on a GPU: the layouts were timed
        out["layout_choice"] = loaded.layout_choice.as_dict()
        print(f"[{name}] layout {loaded.layout_choice.layout}: {loaded.layout_choice.reason}")
    out["gpu_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2) if args.device == "cuda" else 0
    print(f"[{name}] loaded in {out['load_s']} s, {out['gpu_gb']} GB", flush=True)
    runner, gen = core.runner, torch.Generator().manual_seed(0)
    ctx = min(args.forward_context, context)  # the forward-only figures' decode context
    out["forward_context"] = ctx  # their attention reads ctx keys a row (the streams' fewer)
    if graphs:  # every bucket now: capture time apart from the figures below
        t0 = time.perf_counter()
        attempt(out, "graphs_prepared", runner.prepare_graphs, ctx)
        out["graph_prepare_s"] = round(time.perf_counter() - t0, 2)
    out["forward_ms"] = {}
    for rows in levels:
        attempt(out["forward_ms"], str(rows), forward_ms, runner, rows, ctx)
    if args.profile:
        out["profile"] = {}
        rows_list = ([int(r) for r in args.profile_rows.split(",")] if args.profile_rows
                     else sorted({1, max(levels)}))
        for rows in rows_list:
            attempt(out["profile"], str(rows), profile_decode, runner, rows, ctx)
    if graphs and args.graph_profile:
        out["graph_profile"] = {}
        for rows in (int(r) for r in args.graph_profile.split(",")):
            attempt(out["graph_profile"], str(rows), profile_graph, runner, rows, ctx)
    if args.step_profile:  # before the engine's thread drives the core
        attempt(out, "step_profile", profile_steps, core,
                tuple(torch.randint(1000, loaded.config.vocab_size, (32,),
                                    generator=gen).tolist()), args.tokens)
        print(f"[{name}] step profile: {json.dumps(out['step_profile'], indent=1)}",
              flush=True)
    timer = StepTimer(core)
    engine = Engine(core, name=path.stem, loaded=loaded).start()
    vocab = loaded.config.vocab_size

    def prompts(c: int, n: int = args.prompt) -> list[tuple[int, ...]]:
        return [tuple(torch.randint(1000, vocab, (n,), generator=gen).tolist())
                for _ in range(c)]

    try:
        out["decode"], out["prefill"], out["warmup"] = {}, {}, {}
        temperature = 0.8 if "sampled" in parts else 0.0
        builds.start("bench_warmup")
        for c in levels:  # warm-up: compiles, captures the buckets the runs will use
            attempt(out["warmup"], str(c), run_batch, engine, prompts(c), 4, temperature,
                    args.consumers)
        builds.start("measured")  # a build here stalled a measured step
        for c in levels:
            timer.reset()
            row = attempt(out["decode"], str(c), run_batch, engine, prompts(c), args.tokens,
                          temperature, args.consumers)
            if "error" not in row:
                row["per_step_ms"] = timer.per_step_ms()
                row["ahead_steps_so_far"] = core.num_ahead_steps
                row["scheduler"] = scheduler_state(core)
            print(f"[{name}] decode {c}: {row}", flush=True)
        for n in lengths:
            def prefill(n: int = n) -> dict:
                t = time.perf_counter()
                params = SamplingParams(temperature=0.0, max_tokens=1)
                list(engine.stream(Request(f"p{n}-{name}", prompts(1, n)[0], params),
                                   timeout=300))
                dt = time.perf_counter() - t
                return {"tokens": n, "seconds": round(dt, 4), "tok_s": round(n / dt, 1)}
            print(f"[{name}] prefill {n}: {attempt(out['prefill'], str(n), prefill)}",
                  flush=True)
        if runner.graphs is not None:
            out["graphs"] = {"buckets": list(runner.graphs.captured),
                             "graphs": runner.graphs.num_graphs,
                             "replays": runner.graphs.num_replays}
        elif graphs:
            out["graphs"] = {"error": "graphs off (a capture failed: see the log)"}
    finally:
        engine.stop()
        out["builds"] = builds.summary()
        for row in out["builds"].get("measured", {}).get("builds", []):
            print(f"[{name}] built while measured: {row['kernel']} {row['s']} s at "
                  f"{row['at_s']} s: {row['spec'][:200]}", flush=True)


def summarize(variant: dict, bound: dict | None = None) -> None:
    """The headline figures: decode_tps by concurrency, prefill_tps by length, and one
    stream's decode as a share of its bandwidth bound (`bound`: decode_bound's)."""
    variant["decode_tps"] = {c: r.get("total_tok_s")
                             for c, r in variant.get("decode", {}).items()}
    variant["prefill_tps"] = {n: r.get("tok_s") for n, r in variant.get("prefill", {}).items()}
    one = variant["decode_tps"].get("1")
    if bound is not None and isinstance(one, int | float):
        variant["one_stream_pct_of_bound"] = share_of_bound(one, bound)


def print_table(results: dict, levels: list[int], lengths: list[int]) -> None:
    cols = [f"dec@{c}" for c in levels] + [f"fwd@{c} ms" for c in levels] + \
        [f"pre@{n}" for n in lengths]
    print(f"{'variant':<14}" + "".join(f"{c:>12}" for c in cols))
    for name, v in results["variants"].items():
        if "error" in v and "decode" not in v:
            print(f"{name:<14} FAILED: {v['error'][:100]}")
            continue
        cells = [v.get("decode_tps", {}).get(str(c)) for c in levels]
        cells += [v.get("forward_ms", {}).get(str(c), {}).get("ms") for c in levels]
        cells += [v.get("prefill_tps", {}).get(str(n)) for n in lengths]
        print(f"{name:<14}" + "".join(f"{x:12.1f}" if isinstance(x, float | int) else
                                      f"{'-':>12}" for x in cells))
    bound = results.get("bound")
    for name, v in results["variants"].items():
        if bound is not None and "one_stream_pct_of_bound" in v:
            print(f"{name}: {bound_line(v['decode_tps']['1'], bound)}")
    for name, v in results["variants"].items():
        for c, row in v.get("decode", {}).items():
            if "per_step_ms" in row:
                print(f"{name} decode@{c} per step (ms): {row['per_step_ms']}")
        for rows, p in v.get("profile", {}).items():
            if "top" in p:
                print(f"{name} eager decode@{rows}: {p['kernels_per_step']:.0f} kernels, "
                      f"{p['device_ms_per_step']:.2f} ms device time per step")
                for k in p["top"][:6]:
                    print(f"    {k['ms_per_step']:8.4f} ms  x{k['per_step']:<5g} {k['name']}")
        for rows, p in v.get("graph_profile", {}).items():
            if "top" in p:
                print(f"{name} graph decode@{rows}: {p['kernels_per_step']:.0f} kernels, span "
                      f"{p['span_ms_per_step']:.3f} ms, busy {p['busy_ms_per_step']:.3f}, "
                      f"idle {p['idle_ms_per_step']:.3f}, sum {p['sum_ms_per_step']:.3f}")
                for k in p["top"][:12]:
                    print(f"    {k['ms_per_step']:8.4f} ms  x{k['per_step']:<5g} "
                          f"{k['mean_us']:8.2f} us  {k['name']}")
                print(f"{name} graph decode@{rows}, the last step's time by kernel (from the "
                      "previous kernel's end):")
                for kname, us, k in p.get("step_shares", [])[:12]:
                    print(f"    {us / 1e3:8.4f} ms  x{k:<5d} {kname}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default="llama-3.1-8b:Q4_K_M")
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--variants", default=VARIANTS,
                    help="comma list of WEIGHTS[+graphs][+dN], WEIGHTS in "
                         "ggml|q8|bf16|hybrid|auto; +dN: hybrid's bf16 copies from N rows "
                         "(default: measured at load)")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32,
                    help="the decode streams' prompt tokens (their context: this plus the "
                         "tokens decoded so far)")
    ap.add_argument("--prefill", default="512,4096")
    ap.add_argument("--forward-context", type=int, default=256,
                    help="keys a row of the forward-only and profiled decode batches (at "
                         "most the engine's context)")
    ap.add_argument("--consumers", choices=("threads", "asyncio"), default="threads",
                    help="how the decode streams are read: one thread each (Engine.stream) "
                         "or tasks on one event loop (Engine.submit, the server's way)")
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--profile-rows", default="",
                    help="comma list of decode rows to profile (default: 1 and the largest "
                         "concurrency)")
    ap.add_argument("--graph-profile", default="",
                    help="comma list of decode rows whose graph replays to profile (the "
                         "device's timeline: busy, idle and the top kernels)")
    ap.add_argument("--step-profile", action="store_true",
                    help="profile one stream's decode steps (host operations, device busy)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    ap.add_argument("--kv-quant", default=EngineOptions().kv_quant, choices=KV_QUANT_CHOICES,
                    help="the KV format of every variant (and of the bound's KV bytes)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    path = ensure_synthetic(args.synthetic, args.vocab, "/tmp")  # written once, atomically
    print(f"synthetic file {path.stat().st_size / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    lengths = [int(n) for n in args.prefill.split(",")]
    on_gpu = args.device == "cuda" and torch.cuda.is_available()
    results = {"model": args.synthetic.partition(":")[0],
               "quant": args.synthetic.partition(":")[2] or "Q4_K_M",
               "device": torch.cuda.get_device_name() if on_gpu else "cpu",
               "commit": commit_id(),
               "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "tokens_per_stream": args.tokens, "prompt_tokens": args.prompt,
               "consumers": args.consumers, "kv_quant": args.kv_quant,
               "variants": {}}
    out_file = Path(args.out) / "engine_bench.json"
    out_file.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        for variant in results["variants"].values():
            summarize(variant, results.get("bound"))
        out_file.write_text(json.dumps(results, indent=1))

    SAVE.append(save)
    # one stream's bandwidth bound: the bytes a token reads at the streams' last context
    # over this device's measured copy rate (engine/bench/bound.py)
    with ModelFile.open(path) as mf:
        results["bound"] = decode_bound(mf, read_config(mf), args.prompt + args.tokens,
                                        args.kv_quant, copy_rate_gb_s(args.device))
    print(f"bound: {results['bound']}", flush=True)
    for name in args.variants.split(","):
        record: dict = {}
        results["variants"][name] = record
        try:
            with padded_norms(pad_count(name)):
                run_variant(path, name, args, levels, lengths, record)
        except Exception as exc:  # keep the other variants' figures
            record.update({"error": repr(exc), "traceback": traceback.format_exc(limit=12)})
            print(f"[{name}] FAILED {exc!r}", flush=True)
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
        save()
    print_table(results, levels, lengths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
