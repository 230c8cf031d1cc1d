"""qmatmul's decode (skinny) and tiled kernels on the GPU: full-size correctness, bandwidth,
and the config tables to paste into kernels/qgemv.py.

    python3 bench/gpu/qmatmul_bench.py            # on the device machine, about 5 minutes
    TRITON_INTERPRET=1 python3 bench/gpu/qmatmul_bench.py --smoke   # its logic, on the CPU

Llama-3.1-8B's decode shapes at M = 1, 4, 16 (skinny) and 64 (tiled), every type; Q4_K and
Q6_K (a Q4_K_M file's types) swept widest. Each variant is checked against the float64
product of kernels.dequant's reference (within 2^-7 |x| |W|) and its row 0 against M = 1's
at the same split, bit for bit (batch invariance). Times: CUDA graph replays of launches
over enough weight copies to miss the L2, as decode reads each weight once per step; the
ceiling is a 1 GiB device copy, the baselines torch bf16 matmul on dequantized weights and
the previous kernel (git --old-rev or --old-src). "fma" rows: the experimental skinny
kernel without the matrix unit (its bits differ from the others'). Writes
$OUT/qmatmul_bench.json; prints the table and the config dicts last.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, wait
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402

# kernels_check installs a stand-in for gguf-py (absent on the device machine) before
# kernels.dequant needs it, and makes random GGUF blocks with finite f16 scales.
from kernels_check import GGML_TYPES, random_blocks  # noqa: E402

from kernels import qgemv  # noqa: E402
from kernels.dequant import dequantize_reference  # noqa: E402
from kernels.qmatmul import QMMConfig, _lut, qmatmul_tiled, qmatmul_triton  # noqa: E402
from kernels.qtiles import GEOMETRY  # noqa: E402

TYPES = ["Q4_K", "Q6_K", "Q8_0", "Q4_0", "Q5_K", "Q5_0", "IQ4_XS", "MXFP4", "BF16"]
WIDE = ("Q4_K", "Q6_K")
SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
MS = (1, 4, 16, 64)
OLD_REV = "ea7adbd"  # the first kernels (bench/RESULTS.md 2026-11-29); d18f10e: first qgemv
L2_MISS_BYTES = 256 << 20  # weight copies per timing: 5x the H200's L2


def skinny_variants(name: str, m: int, n: int, k: int, plan: tuple[int, int],
                    best: tuple[int, int] | None) -> list[tuple[QMMConfig, bool]]:
    """(config, ticket) for M <= 16: at M = 1 every tile x block_k x split (WIDE types) or
    a few tiles x splits; at M = 4 and 16 the tiles at the plan's and M = 1's best split."""
    step = GEOMETRY[GGML_TYPES[name]][2]
    tiles = [(64, 4), (32, 2)] + ([(128, 4), (128, 8)] if name in WIDE else [])
    ks = [b for b in (256, 128) if b % step == 0 and k % b == 0] if name in WIDE else [plan[0]]
    out = [(QMMConfig(16, 64, *plan, 4), True)]  # the default first
    if m == 1:
        out += [(QMMConfig(16, bn, bk, s, w), True) for bn, w in tiles for bk in ks
                for s in (1, 2, 4, 8)]
        if name in WIDE:  # pipeline depths, and the split sum by a second kernel
            out += [(QMMConfig(16, 64, *plan, 4, st or None), st > 0) for st in (2, 4, 0)]
    else:
        out += [(QMMConfig(16, bn, bk, s, w), True) for bn, w in tiles
                for bk, s in sorted({plan, best or plan})]
    return [(c, t) for c, t in dict.fromkeys(out) if k % (c.block_k * c.split_k) == 0]


def tiled_variants(name: str, k: int, plan: tuple[int, int], best: tuple[int, int] | None):
    tiles = [(64, 64, 4), (64, 128, 8)] + ([(64, 64, 8), (64, 32, 4)] if name in WIDE else [])
    out = [(QMMConfig(bm, bn, bk, s, w), True) for bm, bn, w in tiles
           for bk, s in sorted({plan, best or plan})]
    return [(c, t) for c, t in out if k % (c.block_k * c.split_k) == 0]


def fma_variants(name: str, m: int, k: int) -> list[tuple[QMMConfig, bool]]:
    """The kernel without the matrix unit (M = 1 and 4): tiles x block_k x warps x split."""
    tiles = [(16, 256, 4), (32, 256, 4)] + ([(16, 512, 4), (8, 256, 2), (16, 128, 2)]
                                            if name in WIDE else [])
    out = [(QMMConfig(1 if m == 1 else 4, bn, bk, s, w), True) for bn, bk, w in tiles
           for s in (1, 2, 4, 8)]
    return [(c, t) for c, t in out if k % (c.block_k * c.split_k) == 0]


def label(c: QMMConfig, ticket: bool = True) -> str:
    return (f"bm{c.block_m} bn{c.block_n} bk{c.block_k} s{c.split_k} w{c.num_warps}" + (
        "" if c.num_stages is None else f" st{c.num_stages}") + ("" if ticket else " sum2"))


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.smoke, seed = args.smoke, int(time.time())
        self.dev = torch.device("cpu" if args.smoke else "cuda")
        self.deadline = time.perf_counter() + args.budget_s
        self.gen = torch.Generator(self.dev).manual_seed(seed)
        self.sms = 0 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
        self.out: dict = {"seed": seed, "rows": [], "errors": [], "skipped": []}

    def left(self) -> float:  # seconds
        return self.deadline - time.perf_counter()

    def attempt(self, what: str, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one bad variant must not end the run
            self.out["errors"].append(f"{what}: {type(exc).__name__}: {str(exc)[:300]}")
            print("ERROR", self.out["errors"][-1], flush=True)
            return None

    def time_us(self, calls: list) -> float:
        """Microseconds per call: one CUDA graph of all calls, replayed (the interpreter:
        one call, wall clock)."""
        if self.smoke:
            start, _ = time.perf_counter(), calls[0]()
            return (time.perf_counter() - start) * 1e6
        side = torch.cuda.Stream()  # warm-up off the capture stream, as torch asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            calls[0]()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph := torch.cuda.CUDAGraph()):
            for call in calls:
                call()
        graph.replay()  # uploads the graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):  # >= 256 MiB of weights per replay: 10 replays take 1-5 ms
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / (10 * len(calls))


def ceilings(run: Run) -> dict:
    """Read + write GB/s of an SM copy kernel over 1 GiB (not a copy-engine memcpy node)."""
    src = torch.rand(1 << (18 if run.smoke else 28), device=run.dev, generator=run.gen)
    dst = torch.empty_like(src)
    return {"copy_gb_s": 8 * src.numel() / run.time_us([partial(torch.mul, src, 1.0, out=dst)])
            / 1e3}


def load_old(args: argparse.Namespace):
    """--old-rev's (git) or --old-src's qmatmul, qtiles and qgemv as old_*, importing each
    other; one path for every process, so that Triton's cache serves precompiled builds."""
    src = Path(args.old_src or Path(tempfile.gettempdir()) / f"mbufo-old-qmm-{args.old_rev}")
    mods = ("qmatmul", "qtiles", "qgemv", "qscaled")
    for f in (f"{m}.py" for m in mods):
        if not (src / f"old_{f}").exists():  # written once, by the main process
            text = (src / f).read_text() if (src / f).exists() else subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{args.old_rev}:kernels/{f}"],
                capture_output=True, text=True,
                check=f == "qmatmul.py").stdout  # the others may be absent at that revision
            text = re.sub(r"^from kernels import (.+)$", lambda m: "\n".join(
                f"import old_{n} as {n}" for n in m.group(1).split(", ")), text, flags=re.M)
            for mod in mods:
                text = text.replace(f"kernels.{mod} import", f"old_{mod} import")
            src.mkdir(exist_ok=True)
            (src / f"old_{f}").write_text(text)
    sys.path.insert(0, str(src))
    import old_qmatmul

    return old_qmatmul


def _warm(task: tuple) -> str:
    """Launch one variant on zeros specialized as the real launch is (aligned pointers, row
    bytes and K ranges divisible by 16): fills Triton's on-disk cache; in a worker."""
    kind, name, n, k, m, cfg, ticket, old_rev, old_src = task
    try:
        qtype, dev = GGML_TYPES[name], torch.device("cuda")
        blocks = torch.zeros(n, k // GEOMETRY[qtype][0] * GEOMETRY[qtype][1], dtype=torch.uint8,
                             device=dev)
        x = torch.zeros(m, k, dtype=torch.bfloat16, device=dev)
        lut = _lut(qtype, dev)
        if kind == "old":
            load_old(argparse.Namespace(old_src=old_src, old_rev=old_rev)).qmatmul_triton(
                x, blocks, qtype, (n, k))
        elif kind in ("skinny", "fma"):
            qgemv.qgemv_triton(x, blocks, qtype, n, lut, QMMConfig(*cfg), ticket=ticket,
                               fma=kind == "fma")
        else:  # splits summed in the program, and spread over programs
            for sms in (0, 1 << 20):
                qmatmul_tiled(x, blocks, qtype, n, lut, QMMConfig(*cfg), sms)
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # noqa: BLE001 - reported, the timing run records it again
        return f"{kind} {name} {cfg}: {type(exc).__name__}: {str(exc)[:200]}"


def precompile(run: Run, args: argparse.Namespace) -> None:
    """Build every variant in parallel worker processes before timing, one task per build:
    a skinny build depends on its config and on split 1 vs more (not on M, N or K, see
    qgemv), a tiled one on its config and M's class, the old kernel's on M and config."""
    tasks: dict = {}  # build key -> (kind, type, n, k, m, config, ticket)
    for name, (n, k), m in ((t, shape, m) for t in args.types for shape in args.shapes
                            for m in MS):
        plan = qgemv.k_plan(GGML_TYPES[name], n, k, "cuda", run.sms)
        if m <= 16:
            fmas = [("fma", c, t) for c, t in fma_variants(name, m, k)] if m in (1, 4) else []
            for kind, cfg, ticket in [("skinny", c, t) for c, t in skinny_variants(
                    name, m, n, k, plan, None)] + fmas:
                for c in {tuple(cfg._replace(split_k=1)), tuple(cfg._replace(split_k=2))}:
                    tasks[(kind, name, c, ticket)] = (kind, name, 128, 4096, c[0], c, ticket)
        else:
            for cfg, _ in tiled_variants(name, k, plan, (128, plan[1])):
                tasks[("tiled", name, tuple(cfg))] = ("tiled", name, 128, 4096, m, tuple(cfg), 1)
        if args.old:
            c = tuple(args.old.default_config(GGML_TYPES[name], m, n, k, num_sms=run.sms))
            tasks[("old", name, m, c)] = ("old", name, n, k, m, c, True)
    start, workers = time.perf_counter(), max(1, min(16, (os.cpu_count() or 2) - 1))
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    jobs = [pool.submit(_warm, t + (args.old_rev, args.old_src)) for t in tasks.values()]
    done, late = wait(jobs, timeout=run.left() / 2)  # what is left builds when first run
    pool.shutdown(wait=True, cancel_futures=True)
    run.out["precompile"] = {"tasks": len(jobs), "late": len(late), "seconds": time.perf_counter()
                             - start, "failed": [e for j in done if (e := j.result())]}
    print("precompiled", run.out["precompile"], flush=True)


class Shape:
    """One (type, N, K): weight copies, x, the float64 reference, row-0 references."""

    def __init__(self, run: Run, name: str, n: int, k: int) -> None:
        self.name, self.qtype, self.n, self.k = name, GGML_TYPES[name], n, k
        self.blocks = random_blocks(run, name, n, k)
        self.nbytes = self.blocks.numel()
        count = 1 if run.smoke else max(1, min(64, math.ceil(L2_MISS_BYTES / self.nbytes)))
        self.copies = [self.blocks] + [self.blocks.clone() for _ in range(count - 1)]
        self.x = torch.randn(max(MS), k, device=run.dev, generator=run.gen).bfloat16()
        w = dequantize_reference(self.blocks.view(-1), self.qtype, (n, k), torch.float64)
        self.ref = self.x.double() @ w.T  # (64, N)
        self.bound = self.x.double().abs() @ w.abs().T
        self.w16, self.lut = w.to(torch.bfloat16), _lut(self.qtype, run.dev)
        self.row0: dict = {}  # (fma, split_k) -> row 0 of the first M=1 run


def measure(run: Run, sh: Shape, m: int, cfg: QMMConfig, ticket: bool, kind: str,
            ceil: dict) -> dict:
    """One variant ("skinny", "tiled" or "fma"): checked, compared bit for bit with its
    kernel's first M=1 run at the same split, timed."""
    x = sh.x[:m]
    call = partial(qgemv.qgemv_triton, x, n=sh.n, ggml_type=sh.qtype, lut=sh.lut, cfg=cfg,
                   ticket=ticket, fma=kind == "fma") if m <= 16 else partial(
        qmatmul_triton, x, ggml_type=sh.qtype, shape=(sh.n, sh.k), config=cfg)
    row = {"type": sh.name, "n": sh.n, "k": sh.k, "m": m, "kind": kind, "ok": False,
           "config": label(cfg, ticket), "cfg": list(cfg), "ticket": ticket}
    what = f"{sh.name} ({sh.n},{sh.k}) M={m} {kind} {label(cfg, ticket)}"
    if (y := run.attempt(what, lambda: call(blocks=sh.blocks))) is None:
        return row
    err = float(((y.double() - sh.ref[:m]).abs() / sh.bound[:m]).max())
    row.update(max_err_over_bound=err, ok=bool(torch.isfinite(y).all()) and err <= 2**-7)
    key = (kind == "fma", cfg.split_k)
    first = sh.row0.setdefault(key, y[0].clone()) if m == 1 else sh.row0.get(key)
    row["bits_equal_m1"] = None if first is None else bool(torch.equal(y[0], first))
    us = run.attempt(what, lambda: run.time_us([partial(call, blocks=w) for w in sh.copies]))
    if us is not None:
        gbs = sh.nbytes / us / 1e3
        row.update(us=us, gb_s=gbs, pct_copy=100 * gbs / ceil["copy_gb_s"])
    return row


def baselines(run: Run, sh: Shape, m: int, old, ceil: dict) -> list[dict]:
    """torch bf16 matmul on the dequantized weight, and the previous kernel."""
    x, base = sh.x[:m], {"type": sh.name, "n": sh.n, "k": sh.k, "m": m, "ok": True}
    count = 1 if run.smoke else max(1, min(32, math.ceil(L2_MISS_BYTES / (2 * sh.w16.numel()))))
    w16s = [sh.w16] + [sh.w16.clone() for _ in range(count - 1)]
    us = run.attempt(f"torch {sh.name} M={m}", lambda: run.time_us(
        [partial(torch.matmul, x, w.t()) for w in w16s]))
    out = [] if us is None else [{**base, "kind": "torch_bf16", "us": us,
                                  "gb_s": 2 * sh.w16.numel() / us / 1e3}]
    if old is not None:  # the previous kernel, its default config
        call = partial(old.qmatmul_triton, x, ggml_type=sh.qtype, shape=(sh.n, sh.k))
        us = run.attempt(f"old {sh.name} M={m}", lambda: call(blocks=sh.blocks) is not None
                         and run.time_us([partial(call, blocks=w) for w in sh.copies]))
        out += [{**base, "kind": "old", "us": us, "gb_s": sh.nbytes / us / 1e3}] if us else []
    return out


def best_row(rows: list[dict], **match) -> dict | None:
    """The fastest correct row among those matching `match` (bits_equal_m1 not False)."""
    ok = [r for r in rows if r.get("us") and r["ok"] and r.get("bits_equal_m1") is not False
          and all(r.get(key) == value for key, value in match.items())]
    return min(ok, key=lambda r: r["us"], default=None)


def bench_type_shape(run: Run, args: argparse.Namespace, name: str, n: int, k: int,
                     ceil: dict) -> None:
    sh, rows, best = Shape(run, name, n, k), run.out["rows"], None
    plan = qgemv.k_plan(sh.qtype, n, k, "cuda", run.sms)  # the default's (block_k, split)
    for m in args.ms:
        mma = (skinny_variants(name, m, n, k, plan, best) if m <= 16 else
               tiled_variants(name, k, plan, best))
        fma = fma_variants(name, m, k) if m in (1, 4) else []
        for kind, variants in (("skinny" if m <= 16 else "tiled", mma), ("fma", fma)):
            for cfg, ticket in variants[:2 if run.smoke else None]:
                if run.left() < 10:  # what is left out is listed
                    run.out["skipped"].append(f"{name} ({n},{k}) M={m} {label(cfg, ticket)}")
                    continue
                rows.append(measure(run, sh, m, cfg, ticket, kind, ceil))
                rows[-1]["default"] = kind != "fma" and cfg == variants[0][0] and ticket
        if m == 1 and (pick := best_row(rows, type=name, n=n, k=k, m=1, kind="skinny")):
            best = tuple(pick["cfg"][2:4])
        rows += baselines(run, sh, m, args.old, ceil)
    print(f"{name} ({n},{k}) done, {run.left():.0f}s left", flush=True)


def config_tables(rows: list[dict]) -> dict[str, list[str]]:
    """Entries for kernels/qgemv.py's tables: per (type, N, K) the k plan of the fastest
    M = 1 run, then per M the fastest tiles with that plan and M = 1's bits."""
    out: dict[str, list[str]] = {"K_PLANS": [], "SKINNY_TILES": [], "TILED_TILES": []}
    for name, n, k in sorted({(r["type"], r["n"], r["k"]) for r in rows if "cfg" in r},
                             key=lambda t: (TYPES.index(t[0]), t[1], t[2])):
        mine = [r for r in rows if r["kind"] in ("skinny", "tiled")
                and (r["type"], r["n"], r["k"]) == (name, n, k)]
        if (m1 := best_row(mine, m=1)) is None:
            continue
        qt, plan = GGML_TYPES[name], m1["cfg"][2:4]
        out["K_PLANS"].append(f'("cuda", {qt}, {n}, {k}): ({plan[0]}, {plan[1]}),  # {name} '
                              f'{m1["gb_s"]:.0f} GB/s at M=1')
        for m in sorted({r["m"] for r in mine}):
            if (r := best_row([r for r in mine if r["cfg"][2:4] == plan], m=m)) is None:
                continue
            c, note = r["cfg"], f'  # {name} M={m} {r["gb_s"]:.0f} GB/s'
            if m <= 16:
                out["SKINNY_TILES"].append(f'("cuda", {qt}, {m}, {n}, {k}): '
                                           f'({c[1]}, {c[4]}, {c[5]}),{note}')
            else:
                out["TILED_TILES"].append(f'("cuda", {qt}, {n}, {k}): '
                                          f'({c[0]}, {c[1]}, {c[4]}, {c[5]}),{note}')
    return out


def table(out: dict) -> str:
    rows = out["rows"]
    lines = [f"{out['device']}: copy {out['ceilings']['copy_gb_s']:.0f} GB/s (read + write); "
             "GB/s = weight bytes / time; torch reads bf16 weights (4x Q4_K's bytes)",
             f"{'type':6} {'N':>6} {'K':>5} {'M':>3} | {'def us':>7} {'GB/s':>5} {'%cp':>3} | "
             f"{'best us':>7} {'GB/s':>5} {'%cp':>3} {'best config':29}| {'fma GB/s':>8} "
             f"{'torch':>7} {'old':>7} | ok, bits differ"]

    def cell(r):
        return f"{r['us']:7.1f} {r['gb_s']:5.0f} {r['pct_copy']:3.0f}" if r.get("us") else \
            f"{'-':>7} {'-':>5} {'-':>3}"

    for key in sorted({(r["type"], r["n"], r["k"], r["m"]) for r in rows if "cfg" in r},
                      key=lambda t: (TYPES.index(t[0]), *t[1:])):
        at = [r for r in rows if (r["type"], r["n"], r["k"], r["m"]) == key]
        mine, base = [r for r in at if "cfg" in r], {r["kind"]: r["us"] for r in at
                                                       if "cfg" not in r}
        mma = [r for r in mine if r["kind"] != "fma"] or mine
        d = next((r for r in mma if r.get("default")), mma[0])
        b, f = best_row(mma) or d, best_row([r for r in mine if r["kind"] == "fma"])
        lines.append(f"{key[0]:6} {key[1]:6} {key[2]:5} {key[3]:3} | {cell(d)} | {cell(b)} "
                     f"{b['config']:29}| {f['gb_s'] if f else 0:8.0f} "
                     f"{base.get('torch_bf16', 0):7.1f} {base.get('old', 0):7.1f}"
                     f" | {sum(r['ok'] for r in mine)}/{len(mine)}, "
                     f"{sum(r.get('bits_equal_m1') is False for r in mine)}")
    lines.append(f"correctness failures: {sum(not r['ok'] for r in rows)}; rows whose bits "
                 f"differ from M=1 at the same split: "
                 f"{sum(r.get('bits_equal_m1') is False for r in rows)}; errors: "
                 f"{len(out['errors'])}; skipped: {len(out['skipped'])}")
    lines += [f"{name} = {{\n    " + "\n    ".join(v) + "\n}" for name, v in out["tables"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=270.0, help="then skip (and list)")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--shapes", help="N:K,... weight shapes (default: Llama-3.1-8B's)")
    ap.add_argument("--old-rev", default=OLD_REV, help="git revision of the previous kernel")
    ap.add_argument("--old-src", help="a folder with the previous qmatmul.py and qtiles.py")
    args = ap.parse_args(argv)
    args.types = [t for t in args.types.split(",") if t]
    given = [tuple(int(v) for v in item.split(":")) for item in (args.shapes or "").split(",")
             if item]
    args.shapes, args.ms = ([(64, 512)], (1, 4, 17)) if args.smoke else (given or SHAPES, MS)
    run = Run(args)
    run.out.update(device="cpu (interpreter)" if args.smoke else torch.cuda.get_device_name(),
                   versions=[torch.__version__, __import__("triton").__version__])
    args.old = run.attempt("old kernel", lambda: load_old(args))
    print("ceilings", run.out.setdefault("ceilings", ceilings(run)), flush=True)
    if not args.smoke:
        precompile(run, args)
    for name, (n, k) in ((t, shape) for t in args.types for shape in args.shapes):
        if run.left() < 20:  # listed as skipped
            run.out["skipped"].append(f"{name} ({n},{k})")
        else:
                run.attempt(f"{name} ({n},{k})", partial(bench_type_shape, run, args, name, n, k,
                                                     run.out["ceilings"]))
    run.out.update(tables=config_tables(run.out["rows"]), elapsed_s=time.perf_counter()
                   - (run.deadline - args.budget_s))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qmatmul_bench.json").write_text(json.dumps(run.out, indent=1))
    print(table(run.out))
    return 1 if any(not r["ok"] for r in run.out["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
