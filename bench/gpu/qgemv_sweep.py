"""A wide launch-config sweep of qmatmul's skinny kernel at Llama-3.1-8B's shapes.

    python3 bench/gpu/qgemv_sweep.py --budget-s 240     # on the device machine

Per (type, shape): tile step block_k (64, 128, 256 where the type allows), block_n x
warps (64 x 4, 128 x 8: the wgmma family every path keeps), pipeline stages (Triton's
default, 3) and K splits (the plan's, half and double it); at M = 1, then the five best
again at M = 16. Every run is checked against the float64 product of the dequantized
blocks (within 2^-7 |x| |W|). Times: CUDA-graph replays over weight copies that miss the
L2 (qmatmul_bench's method). Writes $OUT/qgemv_sweep.json and prints the best per shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
from kernels_check import GGML_TYPES, random_blocks  # noqa: E402
from provenance import commit_id  # noqa: E402
from qgemv_variants import SHAPES  # noqa: E402
from qmatmul_bench import L2_MISS_BYTES, Run, ceilings  # noqa: E402

from kernels import qgemv  # noqa: E402
from kernels.dequant import dequantize_reference  # noqa: E402
from kernels.qmatmul import QMMConfig, _lut  # noqa: E402
from kernels.qtiles import GEOMETRY  # noqa: E402

GRID = {"bk": (64, 128, 256), "tiles": ((64, 4), (128, 8)), "st": (None, 3)}


def parse_grid(text: str) -> dict:
    """`bk=128,256;tiles=64x4,64x8;st=0,2` (st 0: Triton's default) -> GRID's form."""
    grid = dict(GRID)
    for part in filter(None, text.split(";")):
        key, values = part.split("=")
        vals = values.split(",")
        if key == "tiles":
            grid[key] = tuple(tuple(int(v) for v in t.split("x")) for t in vals)
        elif key == "st":
            grid[key] = tuple(int(v) or None for v in vals)
        else:
            grid[key] = tuple(int(v) for v in vals)
    return grid


def configs(qtype: int, n: int, k: int, sms: int, grid: dict = GRID,
            block_m: int = 0) -> list[QMMConfig]:
    base = qgemv.default_config(qtype, 1, n, k, num_sms=sms)
    base = base._replace(block_m=block_m or base.block_m)
    step = GEOMETRY[qtype][2]
    out = [base]
    for bk in grid["bk"]:
        if bk % step or k % bk:
            continue
        for bn, w in grid["tiles"]:
            for st in grid["st"]:
                for s in sorted({base.split_k, max(1, base.split_k // 2), base.split_k * 2}):
                    if k % (bk * s) == 0:
                        out.append(base._replace(block_n=bn, block_k=bk, split_k=s,
                                                 num_warps=w, num_stages=st))
    return list(dict.fromkeys(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    ap.add_argument("--grid", default="", help="bk=...;tiles=BNxW,...;st=... (see parse_grid)")
    ap.add_argument("--shapes", default="", help="N,K;N,K (default: Llama-3.1-8B's five)")
    ap.add_argument("--block-m", type=int, default=0,
                    help="x rows per tile in every config (16 with --x-left: mma.sync on sm_90)")
    ap.add_argument("--x-left", default=None,
                    help="types whose kernels take x on the left, replacing qgemv.X_LEFT_TYPES")
    args = ap.parse_args(argv)
    run = Run(args)
    grid = parse_grid(args.grid)
    if args.x_left is not None:
        qgemv.X_LEFT_TYPES = frozenset(GGML_TYPES[t] for t in args.x_left.split(",") if t)
    shapes = [(64, 256)] if args.smoke else SHAPES
    if args.shapes and not args.smoke:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";")]
    out = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(),
           "commit": commit_id(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
           "ceilings": ceilings(run), "rows": [], "best": {}, "grid": str(grid),
           "x_left": sorted(qgemv.X_LEFT_TYPES)}
    for name in args.types.split(","):
        qtype = GGML_TYPES[name]
        for n, k in shapes:
            if run.left() < 10:
                out.setdefault("skipped", []).append(f"{name} ({n},{k})")
                continue
            blocks = random_blocks(run, name, n, k)
            count = max(1, min(64, math.ceil(L2_MISS_BYTES / blocks.numel())))
            copies = [blocks] + [blocks.clone() for _ in range(count - 1)]
            x = torch.randn(16, k, device=run.dev, generator=run.gen).bfloat16()
            w = dequantize_reference(blocks.view(-1), qtype, (n, k), torch.float64)
            ref, bound = x.double() @ w.T, x.double().abs() @ w.abs().T
            lut = _lut(qtype, run.dev)
            rows = []
            cands = configs(qtype, n, k, run.sms, grid, args.block_m)
            for m in (1, 16):
                if m == 16:  # the five best at M = 1, with M = 16's block_m
                    best = sorted((r for r in rows if r.get("us")), key=lambda r: r["us"])[:5]
                    cands = [QMMConfig(*r["config"])._replace(block_m=args.block_m or
                             qgemv.default_config(qtype, 16, n, k).block_m) for r in best]
                for cfg in cands:
                    if run.left() < 5:
                        break
                    call = partial(qgemv.qgemv_triton, x[:m], ggml_type=qtype, n=n, lut=lut,
                                   cfg=cfg)
                    what = f"{name} ({n},{k}) M={m} {cfg}"
                    y = run.attempt(what, partial(call, blocks=blocks))
                    if y is None:
                        continue
                    err = float(((y.double() - ref[:m]).abs() / bound[:m]).max())
                    us = run.attempt(what, partial(run.time_us,
                                                   [partial(call, blocks=c) for c in copies]))
                    row = {"type": name, "n": n, "k": k, "m": m, "config": list(cfg),
                           "err": err, "ok": err <= 2**-7, "us": us,
                           "gb_s": None if us is None else blocks.numel() / us / 1e3,
                           "default": cfg == qgemv.default_config(qtype, m, n, k,
                                                                  num_sms=run.sms)}
                    rows.append(row)
                    print(f"{what}: {us and round(us, 1)} us "
                          f"{row['gb_s'] and round(row['gb_s'])} GB/s err {err:.1e}", flush=True)
            out["rows"] += rows
            for m in (1, 16):
                ok = [r for r in rows if r["m"] == m and r["ok"] and r["us"]]
                if ok:
                    b = min(ok, key=lambda r: r["us"])
                    d = next((r for r in ok if r["default"]), None)
                    out["best"][f"{name} ({n},{k}) M={m}"] = {
                        "best": b["config"], "best_gb_s": b["gb_s"],
                        "default_gb_s": d and d["gb_s"]}
    out["errors"] = run.out["errors"]
    Path(args.out, "qgemv_sweep.json").write_text(json.dumps(out, indent=1))
    for key, v in out["best"].items():
        print(f"{key}: best {v['best']} {v['best_gb_s']:.0f} GB/s, default "
              f"{v['default_gb_s'] and round(v['default_gb_s'])} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
