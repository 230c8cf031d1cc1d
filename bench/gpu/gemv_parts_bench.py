"""Where the one-row CUDA-core product's time goes: kernels/qint.py's `_qint_gemv_kernel` at
one row of x, timed whole and in parts, beside its reads alone (read_pattern_bench's kernel):

- `quant+gemv`: x quantized by its own launch, then the product (what qint_bench times);
- `gemv`: the product alone, x already quantized (the engine's case: a fused producer);
- `no_finish`: the product's programs writing their split partials only (no ticket, no
  sum in split order: the finish's cost is the difference; its output is not a product);
- `split1`: the product without a split (one program a tile: no partials at all);
- `reads_w2` / `reads_w4`: the same grid's reads alone (Q4_K only), on 2 and 4 warps.

    python3 bench/gpu/gemv_parts_bench.py [--out DIR]    # on the device machine

The product's results are checked against kernels.qint.qint_reference (float64) before it
is timed. Times are CUDA-graph replays over weight copies that miss the L2
(qmatmul_bench's method). Writes $OUT/gemv_parts_bench.json and prints a table.
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
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
from kernels_check import GGML_TYPES, random_blocks  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import L2_MISS_BYTES, Run, ceilings  # noqa: E402
from read_pattern_bench import _read_sbs  # noqa: E402

from kernels import qint, qmatmul  # noqa: E402
from kernels.qint import default_qint_config, qint_reference, qint_triton  # noqa: E402
from kernels.quant_x import quantize_x  # noqa: E402

CASES = (("Q4_K", 4096, 4096), ("Q4_K", 6144, 4096), ("Q4_K", 4096, 14336),
         ("Q4_K", 28672, 4096), ("Q6_K", 4096, 14336), ("Q6_K", 4096, 4096))


def parts(run: Run, name: str, n: int, k: int) -> dict:
    qtype = GGML_TYPES[name]
    kind = qint.ACT8_STORED[qtype]
    blocks = random_blocks(run, name, n, k)
    copies = [blocks] + [blocks.clone() for _ in range(max(1, math.ceil(L2_MISS_BYTES
                                                                         / blocks.numel())) - 1)]
    held = [qint.repack_q6k(b, k) if kind == qint.Q6_K_A else b for b in copies]
    x = torch.randn(1, k, device=run.dev, generator=run.gen).bfloat16()
    xq = quantize_x(x)
    cfg = default_qint_config(qtype, n, k, run.sms, m=1)
    ref = qint_reference(x.cpu(), blocks.cpu(), qtype, (n, k)).double()
    scale = ref.abs().max().item()
    row = {"type": name, "n": n, "k": k, "mb": blocks.numel() / 1e6, "config": list(cfg)}
    err = (qint_triton(x, held[0], kind, (n, k), xq=xq).double().cpu() - ref).abs().max()
    row["rel_err"] = float(err) / scale
    row["ok"] = bool(row["rel_err"] <= 2**-16)
    variants = {
        "quant+gemv": lambda w: qint_triton(x, w, kind, (n, k)),
        "gemv": lambda w: qint_triton(x, w, kind, (n, k), xq=xq),
        "split1": lambda w: qint_triton(x, w, kind, (n, k), cfg._replace(split=1), xq=xq),
    }
    for label, call in variants.items():
        row[label] = run.attempt(f"{name} {n}x{k} {label}",
                                 lambda c=call: run.time_us([partial(c, w) for w in held]))
    if cfg.split > 1:  # the partials only: no ticket, and the separate sum made a no-op
        with mock.patch.object(qint, "_TICKETS", 0), \
                mock.patch.object(qmatmul, "sum_splits", lambda part, y: None):
            row["no_finish"] = run.attempt(
                f"{name} {n}x{k} no_finish",
                lambda: run.time_us([partial(variants["gemv"], w) for w in held]))
    if qtype == qint.Q4_K:
        sums = torch.empty(-(-n // 64) * cfg.split, dtype=torch.int32, device=run.dev)
        for warps in (2, 4):
            call = partial(_read_sbs[(-(-n // 64), cfg.split)], out_ptr=sums, N=n, K=k,
                           row_bytes=k // 256 * 144, sb_per_split=k // 256 // cfg.split,
                           nsplit=cfg.split, BLOCK_N=64, TILES=False, num_warps=warps)
            row[f"reads_w{warps}"] = run.attempt(
                f"{name} {n}x{k} reads_w{warps}",
                lambda c=call: run.time_us([partial(c, w) for w in copies]))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=200.0)
    args = ap.parse_args(argv)
    args.smoke = False
    run = Run(args)
    out = run.out
    out.update({"device": torch.cuda.get_device_name(), "commit": commit_id(),
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "ceilings": ceilings(run)})
    labels = ("quant+gemv", "gemv", "no_finish", "split1", "reads_w2", "reads_w4")
    print(f"copy {out['ceilings']['copy_gb_s']:.0f} GB/s; us a launch:")
    print(f"{'type':5} {'N':>6} {'K':>6} ok " + " ".join(f"{v:>10}" for v in labels))
    for name, n, k in CASES:
        if run.left() < 15:
            out["skipped"].append(f"{name} {n}x{k}")
            continue
        row = parts(run, name, n, k)
        out["rows"].append(row)
        print(f"{name:5} {n:6} {k:6} {int(row['ok']):2} " + " ".join(
            f"{row[v]:10.2f}" if row.get(v) else f"{'-':>10}" for v in labels), flush=True)
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gemv_parts_bench.json").write_text(json.dumps(out, indent=1))
    bad = [r for r in out["rows"] if not r["ok"]]
    print(f"failures: {len(bad)}; errors: {len(out['errors'])}")
    return 1 if bad or out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
