"""Engine decode/prefill on a GPU with a synthetic model (real shapes, random weights).

Run on the device machine (see bench/RESULTS.md for the command):
    python bench/gpu/engine_bench.py --synthetic llama-3.1-8b:Q4_K_M --vocab VOCAB.gguf
Writes a JSON summary to $OUT/engine_bench.json (or --out) and prints a table last.
Weights are dequantized to bf16 on the device (torch matmuls); attention is the torch
reference. Decode uses fixed output lengths with ignore_eos.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from engine.build import EngineOptions, build_engine  # noqa: E402
from engine.sampler import SamplingParams  # noqa: E402
from engine.scheduler.request import Request  # noqa: E402
from engine.synthetic import synthetic_spec, write_synthetic_gguf  # noqa: E402


def run_batch(engine, prompts: list[tuple[int, ...]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times: dict[int, list[float]] = {}
    start = time.perf_counter()

    def one(i: int) -> None:
        stamps = []
        for chunk in engine.stream(Request(f"r{i}-{start}", prompts[i], params), timeout=900):
            stamps.extend([time.perf_counter()] * len(chunk.token_ids))
        times[i] = stamps

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = [s[0] for s in times.values()]
    last = max(s[-1] for s in times.values())
    decoded = sum(len(s) - 1 for s in times.values())
    steady_from = max(first)  # every stream is decoding from here on
    in_steady = sum(sum(1 for x in s if x > steady_from) for s in times.values())
    return {"concurrency": len(prompts),
            "ttft_ms_median": statistics.median((f - start) * 1e3 for f in first),
            "total_tok_s": decoded / (last - min(first)),
            "steady_tok_s": in_steady / (last - steady_from) if last > steady_from else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--synthetic", default="llama-3.1-8b:Q4_K_M")
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prefill", default="512,4096")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    args = ap.parse_args()
    path = Path("/tmp") / (args.synthetic.replace(":", "_") + ".gguf")
    t0 = time.perf_counter()
    if not path.exists():
        write_synthetic_gguf(path, synthetic_spec(args.synthetic), args.vocab, seed=0)
    print(f"synthetic file {path.stat().st_size / 1e9:.2f} GB in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    lengths = [int(n) for n in args.prefill.split(",")]
    opts = EngineOptions(sessions=max(levels), context=max(lengths) + args.tokens + 64,
                         prefill_chunk=512, device=args.device, max_pending_per_client=None)
    t0 = time.perf_counter()
    engine = build_engine(str(path), opts)
    on_gpu = torch.cuda.memory_allocated() / 1e9 if args.device == "cuda" else 0.0
    print(f"loaded in {time.perf_counter() - t0:.0f} s; {on_gpu:.1f} GB on the GPU", flush=True)
    vocab = engine.loaded.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    results = {"model": args.synthetic, "device": device_name,
               "decode": [], "prefill": []}
    try:
        run_batch(engine, [tuple(torch.randint(1000, vocab, (32,), generator=gen).tolist())],
                  4)  # warm-up
        for c in levels:
            prompts = [tuple(torch.randint(1000, vocab, (32,), generator=gen).tolist())
                       for _ in range(c)]
            row = run_batch(engine, prompts, args.tokens)
            results["decode"].append(row)
            print("decode", row, flush=True)
        for n in lengths:
            prompt = tuple(torch.randint(1000, vocab, (n,), generator=gen).tolist())
            t = time.perf_counter()
            list(engine.stream(Request(f"p{n}", prompt,
                                       SamplingParams(temperature=0.0, max_tokens=1)),
                               timeout=900))
            dt = time.perf_counter() - t
            results["prefill"].append({"tokens": n, "seconds": dt, "tok_s": n / dt})
            print("prefill", results["prefill"][-1], flush=True)
    finally:
        engine.stop()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "engine_bench.json").write_text(json.dumps(results, indent=1))
    print(f"{'rows':>5} {'total tok/s':>12} {'steady tok/s':>13} {'TTFT ms':>9}")
    for r in results["decode"]:
        print(f"{r['concurrency']:5d} {r['total_tok_s']:12.1f} "
              f"{(r['steady_tok_s'] or 0):13.1f} {r['ttft_ms_median']:9.1f}")
    for r in results["prefill"]:
        print(f"prefill {r['tokens']:6d} tokens: {r['tok_s']:9.0f} tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
