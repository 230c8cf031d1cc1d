"""kernels/qint_mma.py (Gluon, operands loaded into mma.sync registers) against qint's
matrix-unit kernel on the GPU, Q4_K at Llama-3.1-8B's shapes and 9-16 rows of x.

    python3 bench/gpu/qint_mma_bench.py [--variants 4,16,8;2,16,8] [--out DIR]

Each variant (warps, rows a warp, k_width) is checked bit for bit against qint_triton's
output at the same split, and against the float64 reference of kernels.qint (within 2^-16
|W| |x_q|); times are CUDA-graph replays over weight copies that miss the L2, as
qint_bench. Writes $OUT/qint_mma_bench.json.
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
from kernels_check import random_blocks  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import L2_MISS_BYTES, Run, ceilings  # noqa: E402

from kernels import qint, qint_mma  # noqa: E402
from kernels.dequant import dequantize_reference  # noqa: E402
from kernels.qgemv import _tickets  # noqa: E402

SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (14336, 4096), (4096, 14336),
          (1024, 4096)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--variants", default=";".join((
        "4,16,8,1,1,2", "2,16,8,1,1,2", "4,16,8,1,1,2,0,64", "4,16,8,1,1,3,0,80",
        "2,16,8,1,1,3", "8,16,8,1,1,2")))
    ap.add_argument("--splits", default="", help="extra split factors (x the default)")
    ap.add_argument("--rows", default="16,9")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    run = Run(args)
    variants = [tuple(int(v) for v in t.split(",")) for t in args.variants.split(";") if t]
    rows = [int(r) for r in args.rows.split(",")]
    ceil = ceilings(run)
    print("copy ceiling", round(ceil["copy_gb_s"]), "GB/s", flush=True)
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit_id(),
           "device": torch.cuda.get_device_name(0), "ceilings": ceil, "rows": [],
           "errors": run.out["errors"]}
    tickets = _tickets(run.dev)
    for n, k in SHAPES:
        if run.left() < 20:
            out["errors"].append(f"budget: stopped before {n}x{k}")
            break
        blocks = random_blocks(run, "Q4_K", n, k)
        copies = [blocks] + [blocks.clone() for _ in range(
            max(1, min(64, math.ceil(L2_MISS_BYTES / blocks.numel()))) - 1)]
        w = dequantize_reference(blocks.view(-1), qint.Q4_K, (n, k), torch.float64)
        x = torch.randn(16, k, device=run.dev, generator=run.gen).bfloat16()
        xq_ref = qint.dequantized_x_reference(x)
        ref, bound = xq_ref @ w.T, xq_ref.abs() @ w.abs().T
        del w
        for m in rows:
            xq = qint.quantize_x(x[:m])
            cfg = qint.default_qint_config(qint.Q4_K, n, k, run.sms, m=m)
            old = qint.qint_triton(x[:m], blocks, qint.Q4_K, (n, k), xq=xq)
            row = {"n": n, "k": k, "m": m, "split": cfg.split}
            if m == 16:
                row["old_us"] = run.time_us([partial(qint.qint_triton, x[:m], b, qint.Q4_K,
                                                     (n, k), xq=xq) for b in copies])
            splits = [cfg.split] + [cfg.split * int(f) for f in args.splits.split(",") if f
                                    if (k // 256) % (cfg.split * int(f)) == 0]
            for var in variants:
                full = (*var, *(2, 1, 0, 0, 0)[len(var) - 3:])
                warps, rpw, kw, unroll, xs, st, per_sm, regs = full
                for split in splits:
                    tag = (f"w{warps}_r{rpw}_k{kw}_u{unroll}_x{xs}_s{split}" if not st
                           else f"w{warps}_r{rpw}_async{st}_s{split}")
                    tag += (f"_p{per_sm}" if per_sm else "") + (f"_reg{regs}" if regs else "")
                    call = partial(qint_mma.qint_mma_launch, xq, n=n, k=k, split=split,
                                   warps=warps, rows_per_warp=rpw, k_width=kw, tickets=tickets,
                                   unroll=unroll, xsmem=bool(xs), stages=st,
                                   programs=per_sm * run.sms, max_regs=regs or None)
                    y = run.attempt(f"{n}x{k} m{m} {tag}", lambda c=call, b=blocks: c(b))
                    if y is None:
                        continue
                    err = float(((y.double() - ref[:m]).abs() / bound[:m]).max())
                    res = {"err": err, "ok": bool(torch.isfinite(y).all()) and err <= 2**-16}
                    if split == cfg.split:
                        res["bits_equal_qint"] = bool(torch.equal(y, old))
                    if m == 16:
                        us = run.attempt(tag, lambda c=call, cs=copies: run.time_us(
                            [partial(c, b) for b in cs]))
                        if us is not None:
                            res["us"] = us
                            res["gb_s"] = blocks.numel() / us / 1e3
                    row[tag] = res
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qint_mma_bench.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
