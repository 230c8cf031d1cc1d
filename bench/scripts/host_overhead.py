"""Host (Python) cost of one engine decode step at 1 / 16 / 64 rows, the forward excluded.

    python bench/scripts/host_overhead.py [--rows 1,16,64] [--steps 150] [--prompt 32]
        [--modes greedy,topp,full] [--engine] [--profile greedy:64] [--json]

A tiny synthetic Llama with a real vocabulary (ggml-vocab-llama-bpe.gguf from the
llama-cpp-python sdist; by default the copy the tests unpack into ~/.cache/mbufo-tests)
runs through the real EngineCore, Scheduler, ModelRunner with decode graphs on, Sampler,
detokenizer and stop checks. Only the model is replaced: the "graph" that the runner
captures and replays returns fixed random logits (`--width` columns, ids below it are
real tokens of the vocabulary), and eager steps (prefill) return the same. So a decode step
costs exactly its host work: planning, batch building, graph staging, sampling (small
tensor ops, as cheap here as their launches are on a GPU), detokenization, stop checks and
output chunks. The figure per step is the median over `--repeats` runs of `--steps`
decode-only steps each, in the thread's CPU time (other processes on a busy machine count
less); `stats` is EngineStats (Engine calls it after every step).

Modes: greedy (temperature 0); topp (temperature 0.8, top_p 0.95, a seed per request);
full (topp + repetition/frequency penalties, 5 logprobs and a stop string).
`--engine` also runs the Engine thread with one consuming thread per stream (as
bench/gpu/engine_bench.py does), then with every stream an asyncio task on one event loop
(as the server consumes them), and reports its decode steps per second.

With `--model FILE.gguf --device cuda` the real model runs (decode graphs captured ahead
for the context used): the figures are wall-clock decode-only steps with every row
decoding, and `--breakdown`'s `forward` includes the device time (a sync after it), so
`step - forward` is the host work the GPU waits for. E.g. on the GPU machine, with the
file bench/gpu/engine_bench.py writes:
    python bench/scripts/host_overhead.py --model /tmp/llama-3.1-8b_Q4_K_M.gguf
        --device cuda --weights bf16 --modes greedy,topp --breakdown --steps 60 --repeats 2
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import engine.core  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.engine import Engine  # noqa: E402
from engine.loader import load  # noqa: E402
from engine.runner import ModelRunner  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler.request import Request  # noqa: E402
from engine.scheduler.scheduler import SchedulerConfig  # noqa: E402
from engine.synthetic import SyntheticSpec, write_synthetic_gguf  # noqa: E402

VOCAB = (Path.home() / ".cache" / "mbufo-tests" / "llama_cpp_python-0.3.36" / "vendor"
         / "llama.cpp" / "models" / "ggml-vocab-llama-bpe.gguf")
PAGE_SIZE = 16
PREFILL_CHUNK = 512
# This thread's CPU time: other processes on a busy machine do not count (the work timed is
# all on this thread, with one torch thread).
CLOCK = time.thread_time
MODES = {
    "greedy": dict(temperature=0.0),
    "topp": dict(temperature=0.8, top_p=0.95),
    "full": dict(temperature=0.8, top_p=0.95, repetition_penalty=1.1, frequency_penalty=0.2,
                 logprobs=5, stop=("\n\n\n\n\n",)),
}


class StaticGraph:
    """Stands in for CUDA graph capture: the captured step is run once (it returns fixed
    logits, see `make_core`) and a replay does nothing."""

    def __call__(self, fn):
        out = fn()
        return (lambda: None), out


def real_core(args, rows: int, context: int) -> EngineCore:
    """The real model on args.device, graphs captured for rows of up to `context` tokens."""
    from engine.build import EngineOptions, build_core, load_for

    opts = EngineOptions(sessions=rows, context=context, prefill_chunk=PREFILL_CHUNK,
                         itl_target_ms=None,
                         max_pending_per_client=None, device=args.device, cuda_graphs=True,
                         weights=args.weights)
    core = build_core(load_for(args.model, opts), opts)
    core.runner.prepare_graphs(context)  # type: ignore[attr-defined]
    return core


def make_core(path: Path, rows: int, context: int, width: int) -> EngineCore:
    loaded = load(path, torch.float32, "cpu")
    pages = rows * -(-context // PAGE_SIZE) + 8
    runner = ModelRunner(loaded.model, pages, PAGE_SIZE, cuda_graphs=True, max_context=context,
                         capture=StaticGraph())
    logits = torch.randn(64, width, generator=torch.Generator().manual_seed(0)) * 3
    assert runner.graphs is not None
    runner.graphs.step = lambda batch, splits: logits[:batch.num_rows]
    runner.forward_eager = lambda batch: logits[:len(batch.logits_rows)].clone()
    config = SchedulerConfig(max_sessions=rows, context=context, prefill_chunk=PREFILL_CHUNK,
                             itl_target_ms=None, prefix_cache=False)
    return EngineCore(runner, loaded.tokenizer, config, vocab_size=width)


def requests(rows: int, mode: str, prompt: int, max_tokens: int, width: int,
             tag: str) -> list[Request]:
    g = torch.Generator().manual_seed(rows)
    out = []
    for i in range(rows):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **MODES[mode])
        ids = tuple(torch.randint(1, width, (prompt,), generator=g).tolist())
        out.append(Request(f"{tag}-{i}", ids, params))
    return out


class Breakdown:
    """Thread CPU time inside the step's parts (mean per step), by wrapping them."""

    PARTS = (("scheduler", "schedule"), ("build", "build_batch"), ("runner", "forward"),
             ("sampler", "sample"), ("scheduler", "update"), ("scheduler", "observe"))

    def __init__(self, core: EngineCore, sync=None) -> None:
        self.acc = {name: 0.0 for _, name in self.PARTS}
        self.on = False
        self.sync = sync  # after the forward: its device time counts as `forward`
        self.build = engine.core  # build_batch is looked up in the core's module
        for owner, name in self.PARTS:
            obj = getattr(core, owner, None) if owner != "build" else self.build
            setattr(obj, name, self._timed(getattr(obj, name), name))

    def _timed(self, fn, name: str):
        def wrapper(*args, **kwargs):
            t = CLOCK()
            try:
                out = fn(*args, **kwargs)
                if name == "forward" and self.sync is not None:
                    self.sync()
                return out
            finally:
                if self.on:
                    self.acc[name] += CLOCK() - t
        return wrapper

    def per_step_ms(self, steps: int, step_ms: float) -> dict[str, float]:
        out = {k: round(v / steps * 1e3, 3) for k, v in self.acc.items()}
        out["rest"] = round(step_ms - sum(out.values()), 3)  # postprocess loop, outputs
        return out


def decode_tokens(args, rows: int) -> int:
    """Tokens a request decodes: the timed steps and warm-up, and the steps that the other
    rows' prompts take to prefill, so that the first rows still decode when the last
    start (every row decoding at once)."""
    return args.steps + 8 + rows + -(-rows * args.prompt // PREFILL_CHUNK)


def decode_times(core: EngineCore, rows: int, mode: str, args, tag: str,
                 parts: Breakdown | None = None) -> tuple[list[float], list[float]]:
    """Per decode-only step, all `rows` rows decoding: (step seconds, stats seconds)."""
    for r in requests(rows, mode, args.prompt, decode_tokens(args, rows), args.width, tag):
        core.add(r)
    prefill_steps = 2 * (rows + -(-rows * args.prompt // PREFILL_CHUNK)) + 16
    for _ in range(prefill_steps):  # prefill (and the first token)
        if len(core.scheduler.decode_queue) >= rows:
            break
        core.step()
    else:
        raise RuntimeError(f"{rows} rows never decoded at once in {prefill_steps} steps")
    for _ in range(3):  # captures, first-use caches
        core.step()
    steps, stats = [], []
    if parts is not None:
        parts.on = True
    for _ in range(args.steps):
        t0 = CLOCK()
        core.step()
        t1 = CLOCK()
        core.stats()
        steps.append(t1 - t0)
        stats.append(CLOCK() - t1)
    if parts is not None:
        parts.on = False
    for r in list(core.scheduler.seqs):
        core.abort(r)
    while core.has_work():
        core.step()
    return steps, stats


def engine_steps_per_s(path: Path, rows: int, mode: str, args, *, tasks: bool = False) -> float:
    """Decode steps per second of the Engine thread with one consumer thread per stream,
    or (`tasks`) with every stream an asyncio task on one event loop, as the server runs
    them (Engine.submit: one hand-off per loop and step)."""
    core = make_core(path, rows, args.prompt + args.steps + 64, args.width)
    engine = Engine(core, "host-overhead").start()
    marks: list[tuple[float, int]] = []
    reqs = requests(rows, mode, args.prompt, args.steps, args.width, "eng")

    def mark(chunk) -> None:
        if chunk.request_id.endswith("-0"):
            marks.append((time.perf_counter(), core.num_steps))

    if tasks:
        async def consume_all() -> None:
            async def consume(req: Request) -> None:
                async for chunk in engine.submit(req):
                    mark(chunk)

            await asyncio.gather(*(consume(r) for r in reqs))

        asyncio.run(consume_all())
    else:
        def consume(req: Request) -> None:
            for chunk in engine.stream(req, timeout=120):
                mark(chunk)

        threads = [threading.Thread(target=consume, args=(r,)) for r in reqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    engine.stop()
    (t0, s0), (t1, s1) = marks[len(marks) // 4], marks[-2]  # all rows decoding
    return (s1 - s0) / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--modes", default="greedy,topp,full")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--width", type=int, default=1024, help="logits columns")
    ap.add_argument("--vocab", default=str(VOCAB))
    ap.add_argument("--engine", action="store_true",
                    help="also time the Engine thread (tiny model)")
    ap.add_argument("--breakdown", action="store_true", help="CPU time per part of a step")
    ap.add_argument("--profile", default=None,
                    help="MODE:ROWS: cProfile one run (tiny model), top 25")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--model", default=None, help="a GGUF whose real forward runs instead")
    ap.add_argument("--device", default="cuda", help="with --model")
    ap.add_argument("--weights", default="auto", help="with --model: auto, bf16 or ggml")
    args = ap.parse_args()
    global CLOCK
    if args.model:  # device waits are not this thread's CPU time
        CLOCK = time.perf_counter
    path = Path(tempfile.gettempdir()) / f"host_overhead_{os.getuid()}.gguf"
    if not args.model or args.engine or args.profile:  # these use the tiny model
        if not Path(args.vocab).exists():
            sys.exit(f"no vocabulary at {args.vocab}: run the tokenizer tests once (they "
                     "unpack the llama-cpp-python sdist) or pass --vocab")
        torch.set_num_threads(1)
        spec = SyntheticSpec("llama", num_layers=2, hidden_size=64, num_heads=4,
                             num_kv_heads=2, head_dim=16, ffn_size=128)
        if not path.exists():
            write_synthetic_gguf(path, spec, args.vocab, seed=0)
    levels = [int(r) for r in args.rows.split(",")]
    context = args.prompt + decode_tokens(args, max(levels)) + 64
    result: dict = {"steps": args.steps, "prompt": args.prompt, "width": args.width}
    if args.profile:
        mode, rows = args.profile.split(":")
        core = make_core(path, int(rows), context, args.width)
        prof = cProfile.Profile()
        prof.enable()
        decode_times(core, int(rows), mode, args, "prof")
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    sync = torch.cuda.synchronize if args.model and args.device.startswith("cuda") else None
    for mode in args.modes.split(","):
        for rows in levels:
            if args.model:
                core = real_core(args, rows, context)
                args.width = result["width"] = core.vocab_size
            else:
                core = make_core(path, rows, context, args.width)
            parts = Breakdown(core, sync) if args.breakdown else None
            steps, stats_s = [], []
            for k in range(args.repeats):
                a, b = decode_times(core, rows, mode, args, f"{mode}{rows}-{k}", parts)
                steps += a
                stats_s += b
            step, stats = statistics.median(steps) * 1e3, statistics.median(stats_s) * 1e3
            result[f"{mode}@{rows}"] = {"step_ms": round(step, 3), "stats_ms": round(stats, 3)}
            print(f"{mode:>6} @ {rows:>2} rows: step {step:7.3f} ms  stats {stats:6.3f} ms  "
                  f"({step / rows * 1e3:6.1f} us per row)", file=sys.stderr, flush=True)
            if parts is not None:
                mean = statistics.fmean(steps) * 1e3
                result[f"{mode}@{rows}"]["parts_ms"] = split = parts.per_step_ms(len(steps), mean)
                print(f"        mean {mean:.3f} ms: {split}", file=sys.stderr, flush=True)
    if args.engine:
        for rows in levels:
            for tasks, key, how in ((False, "engine", "consumer threads"),
                                    (True, "engine_async", "asyncio tasks on one loop")):
                sps = engine_steps_per_s(path, rows, "greedy", args, tasks=tasks)
                result[f"{key}@{rows}"] = {"steps_per_s": round(sps, 1),
                                           "ms_per_step": round(1e3 / sps, 3)}
                print(f"engine greedy @ {rows:>2} rows: {sps:7.1f} steps/s ({1e3 / sps:6.3f} "
                      f"ms per step, {rows} {how})", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
