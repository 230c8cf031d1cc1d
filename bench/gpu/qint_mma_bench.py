"""kernels/qint_mma.py (Gluon, asynchronous copies into mma.sync fragments) against qint's
matrix-unit kernel on the GPU, Q4_K and Q6_K at Llama-3.1-8B's shapes and 9-64 rows of x.

    python3 bench/gpu/qint_mma_bench.py [--types Q4_K,Q6_K,fused] [--variants 4,2;4,3;8,2]
        [--rows 16,9] [--out DIR]

A variant is warps,stages[,register cap a thread].

`fused` times q|k (Q4_K) and v (Q6_K) in one launch through qint_parts, as the engine
multiplies a layer's attention input on llama.cpp's Q6_K layers.

Each variant (warps, stages) is checked bit for bit against qint's launch with the default
tile of the rows' bound forced (qint_triton itself takes the Gluon kernel; forced, up to
gemv_max_m rows of the type run on the CUDA cores, more on _qint_mm_kernel) and against the
float64 reference of kernels.qint (within 2^-16 |W| |x_q|); both are timed at every row
count (--rows), as CUDA-graph replays over weight copies that miss the L2, as qint_bench.
GB/s counts the weights' bytes, also as a percentage of the copy ceiling measured in the
same run; TOPS counts 2 m n k integer operations, also as a percentage of the int8 matrix
ceiling measured in the same run (torch._int_mm, cuBLASLt's int8 GEMM, at 8192 x 8192 x
8192): at 64 rows the products are neither bandwidth- nor matrix-bound. Writes
$OUT/qint_mma_bench.json.
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

from kernels import qint, qint_mm, qint_mma, quant_x  # noqa: E402
from kernels.dequant import dequantize_reference  # noqa: E402
from kernels.qgemv import _tickets  # noqa: E402

# Llama-3.1-8B Q4_K_M: Q4_K's q|k|v, o, gate|up, a half of the layers' down, v alone;
# Q6_K's down and v on the other half, and the output head
SHAPES = {"Q4_K": [(4096, 4096), (6144, 4096), (28672, 4096), (14336, 4096), (4096, 14336),
                   (1024, 4096)],
          "Q6_K": [(4096, 14336), (128256, 4096), (1024, 4096)]}


def int8_ceiling(run: Run, size: int = 8192) -> float:
    """TOPS of torch._int_mm (int8 x int8 -> int32) on two (size, size) matrices."""
    a = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=run.dev,
                      generator=run.gen)
    b = torch.randint(-127, 128, (size, size), dtype=torch.int8, device=run.dev,
                      generator=run.gen)
    return 2 * size ** 3 / run.time_us([partial(torch._int_mm, a, b)]) / 1e6


def rates(res: dict, nbytes: int, ops: int, ceil: dict) -> dict:
    """res with GB/s of the weights' bytes and TOPS of `ops`, each against its ceiling."""
    res["gb_s"] = nbytes / res["us"] / 1e3
    res["pct_copy"] = 100 * res["gb_s"] / ceil["copy_gb_s"]
    res["tops"] = ops / res["us"] / 1e6
    res["pct_int8"] = 100 * res["tops"] / ceil["int8_tops"]
    return res


def forced(m: int) -> tuple:
    """qint's default matrix-unit tile at m rows (the first candidate of m's bound)."""
    bound = next(b for b in qint_mm.TILE_BOUNDS if m <= b)
    return qint_mm.TILE_CANDIDATES["cuda"][bound][0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--variants", default="4,2;4,3;2,2;8,2")
    ap.add_argument("--splits", default="", help="extra split factors (x the default)")
    ap.add_argument("--rows", default="16,9")
    ap.add_argument("--types", default="Q4_K,Q6_K,fused")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    run = Run(args)
    variants = [tuple(int(v) for v in t.split(",")) for t in args.variants.split(";") if t]
    rows = [int(r) for r in args.rows.split(",")]
    ceil = {**ceilings(run), "int8_tops": int8_ceiling(run)}
    print("copy ceiling", round(ceil["copy_gb_s"]), "GB/s; int8 matrix ceiling",
          round(ceil["int8_tops"]), "TOPS", flush=True)
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit_id(),
           "device": torch.cuda.get_device_name(0), "ceilings": ceil, "rows": [],
           "errors": run.out["errors"]}
    tickets = _tickets(run.dev)
    for name, n, k in [(t, n, k) for t in args.types.split(",") for n, k in SHAPES.get(t, [])]:
        if run.left() < 20:
            out["errors"].append(f"budget: stopped before {name} {n}x{k}")
            break
        q6 = name == "Q6_K"
        qtype = qint.Q6_K_A if q6 else qint.Q4_K
        gguf_blocks = random_blocks(run, name, n, k)
        blocks = qint.repack_q6k(gguf_blocks, k) if q6 else gguf_blocks
        copies = [blocks] + [blocks.clone() for _ in range(
            max(1, min(64, math.ceil(L2_MISS_BYTES / blocks.numel()))) - 1)]
        w = dequantize_reference(gguf_blocks.view(-1), qint.Q6_K if q6 else qint.Q4_K, (n, k),
                                 torch.float64)
        del gguf_blocks
        x = torch.randn(max(rows), k, device=run.dev, generator=run.gen).bfloat16()
        xq_ref = quant_x.dequantized_x_reference(x)
        ref, bound = xq_ref @ w.T, xq_ref.abs() @ w.abs().T
        del w
        for m in rows:
            xq = quant_x.quantize_x(x[:m])
            cfg = qint.default_qint_config(qtype, n, k, run.sms, m=m)
            tile = forced(m)

            def old_call(b, xm=x[:m], xqm=xq, nk=(n, k), qt=qtype, tile=tile):
                with qint_mm.forced_tile(tile):
                    return qint.qint_triton(xm, b, qt, nk, xq=xqm)

            old = old_call(blocks)
            row = {"type": name, "n": n, "k": k, "m": m, "split": cfg.split}
            row["old_us"] = run.time_us([partial(old_call, b) for b in copies])
            splits = [cfg.split] + [cfg.split * int(f) for f in args.splits.split(",") if f
                                    if (k // 256) % (cfg.split * int(f)) == 0]
            for warps, stages, *cap in variants:
                for split in splits:
                    tag = f"w{warps}_st{stages}_s{split}" + (f"_r{cap[0]}" if cap else "")
                    call = partial(qint_mma.qint_mma_launch, xq, n=n, k=k, split=split,
                                   tickets=tickets, q6=q6, warps=warps, stages=stages,
                                   max_regs=cap[0] if cap else None)
                    y = run.attempt(f"{name} {n}x{k} m{m} {tag}", lambda c=call, b=blocks: c(b))
                    if y is None:
                        continue
                    err = float(((y.double() - ref[:m]).abs() / bound[:m]).max())
                    res = {"err": err, "ok": bool(torch.isfinite(y).all()) and err <= 2**-16}
                    if split == cfg.split:
                        res["bits_equal_qint"] = bool(torch.equal(y, old))
                    us = run.attempt(tag, lambda c=call, cs=copies: run.time_us(
                        [partial(c, b) for b in cs]))
                    if us is not None:
                        res["us"] = us
                        rates(res, blocks.numel(), 2 * m * n * k, ceil)
                    row[tag] = res
            print(json.dumps(row), flush=True)
            out["rows"].append(row)
    if "fused" in args.types.split(",") and run.left() >= 20:
        out["rows"] += fused_rows(run, rows, ceil)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qint_mma_bench.json").write_text(json.dumps(out, indent=1))
    return 0


def fused_rows(run: Run, rows: list[int], ceil: dict, n1: int = 5120, n2: int = 1024,
               k: int = 4096) -> list[dict]:
    """q|k (Q4_K, n1 rows) and v (Q6_K, n2) in one launch, as the engine's qint_parts:
    the two-type Gluon kernel against qint's two-type tile (forced), bit for bit and
    within 2^-16 of the float64 definition of each part; timed at each of `rows`."""
    g1, g2 = random_blocks(run, "Q4_K", n1, k), random_blocks(run, "Q6_K", n2, k)
    w = torch.cat([dequantize_reference(g1.view(-1), qint.Q4_K, (n1, k), torch.float64),
                   dequantize_reference(g2.view(-1), qint.Q6_K, (n2, k), torch.float64)])
    sets = [[(g1, qint.Q4_K, n1), (qint.repack_q6k(g2, k), qint.Q6_K_A, n2)]]
    size = g1.numel() + sets[0][1][0].numel()
    sets += [[(b.clone(), t, n) for b, t, n in sets[0]]
             for _ in range(max(1, min(64, math.ceil(L2_MISS_BYTES / size))) - 1)]
    x = torch.randn(max(rows), k, device=run.dev, generator=run.gen).bfloat16()
    xq_ref = quant_x.dequantized_x_reference(x)
    ref, bound = xq_ref @ w.T, xq_ref.abs() @ w.abs().T
    out = []
    for m in rows:
        xq, tile = quant_x.quantize_x(x[:m]), forced(m)

        def old(parts, xm=x[:m], xqm=xq, tile=tile):
            with qint_mm.forced_tile(tile):
                return qint.qint_parts(xm, parts, k, xq=xqm)

        def new(parts, xm=x[:m], xqm=xq):
            return qint.qint_parts(xm, parts, k, xq=xqm)

        y = run.attempt(f"fused m{m}", lambda c=new: c(sets[0]))
        if y is None:
            continue
        err = float(((y.double() - ref[:m]).abs() / bound[:m]).max())
        row = {"type": "Q4_K+Q6_K", "n": n1 + n2, "n1": n1, "k": k, "m": m, "err": err,
               "ok": bool(torch.isfinite(y).all()) and err <= 2**-16,
               "bits_equal_qint": bool(torch.equal(y, old(sets[0])))}
        row["old_us"] = run.time_us([partial(old, p) for p in sets])
        row["us"] = run.time_us([partial(new, p) for p in sets])
        rates(row, size, 2 * m * (n1 + n2) * k, ceil)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
