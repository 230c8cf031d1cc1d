"""kernels/qint.py (8-bit activations, CUDA cores) against qmatmul's skinny kernel on the
GPU, at Llama-3.1-8B's shapes: correctness, a row's bits across M, bandwidth, a sweep.

    python3 bench/gpu/qint_bench.py [--budget-s 400]   # on the device machine

Every qint run is checked against kernels.qint.qint_reference (float64, within 2^-16
|W| |x_q|) and its row 0 against the M = 1 row 0 bit for bit; qmatmul's against its
2^-7 bound. Times are CUDA-graph replays over weight copies that miss the L2
(bench/gpu/qmatmul_bench.py's method); GB/s counts the GGML bytes. Writes
$OUT/qint_bench.json and prints a table. --smoke runs tiny shapes in the interpreter.
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
from qmatmul_bench import L2_MISS_BYTES, Run, ceilings  # noqa: E402

from kernels import qint, qint_mm  # noqa: E402
from kernels.dequant import dequantize_reference  # noqa: E402
from kernels.qint import QIntConfig, default_qint_config, qint_triton  # noqa: E402
from kernels.qmatmul import qmatmul_triton  # noqa: E402
from kernels.quant_x import dequantized_x_reference  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
MS = (1, 2, 3, 4, 8, 16, 32, 64)
# The matrix-unit kernel's tiles swept (block_m, block_n, num_warps[, num_stages[, max_regs]])
# and the rows of x each is timed at. At 16 rows: the register cap (3 or 4 programs a
# multiprocessor); at 32 and 64: tiles whose sm_90 builds do not spill (32 x 128 and 64 x 128
# on 4 warps take 254-255 registers and spill 24-840 bytes a thread).
TILE_SWEEP = (((16, 64, 4), (16,)), ((16, 64, 4, None, 128), (16,)),
              ((16, 64, 4, None, 96), (16,)), ((16, 64, 4, 2, 96), (16,)),
              ((16, 64, 4, None, 80), (16,)), ((32, 64, 4, None, 128), (32, 64)),
              ((16, 64, 4, None, 120), (16,)), ((16, 64, 4, 4, 120), (16,)),
              ((32, 128, 4), (32,)), ((32, 64, 4), (32,)), ((32, 128, 8), (32,)),
              ((64, 128, 4), (64, 512)), ((64, 64, 8), (64, 512)), ((64, 128, 8), (64, 512)),
              ((32, 64, 4), (64,)), ((128, 64, 8), (512,)))


def parse_tiles(text: str) -> tuple:
    """--tiles: 'bm,bn,warps[,stages[,max_regs]];...' -> TILE_SWEEP's form at 16 and 32 rows."""
    return tuple((tuple(int(v) if v else None for v in t.split(",")), (16, 32))
                 for t in text.split(";") if t)


def sweep(base: QIntConfig, regs: tuple[int | None, ...] = (None,)) -> list[QIntConfig]:
    """The CUDA-core kernel's configs around `base`: rows a program, warps, splits and the
    register caps `regs` (None: uncapped)."""
    out = [QIntConfig(bn, s, w, None, r) for bn in (32, 64, 128) for w in (2, 4, 8)
           for s in sorted({max(1, base.split // 4), max(1, base.split // 2), base.split,
                            base.split * 2}) for r in regs]
    return [c for c in out if c != base]


def in_cta_sweep(base: QIntConfig) -> list[QIntConfig]:
    """One-row programs that take every split of their rows (QIntConfig.in_cta) around
    `base`'s split: 32-128 (split, weight row) rows on 1-8 warps, capped at 128 registers
    on up to 2 warps."""
    s = base.split
    out = []
    for rows in (32, 64, 128):
        for warps in (1, 2, 4, 8):
            if s == 1 or rows % s or (rows == 128 and warps == 1) or (rows == 32 and warps == 8):
                continue
            out.append(QIntConfig(rows // s, s, warps, None, 128 if warps <= 2 else None,
                                  base.x_early, in_cta=True))
    return out


class Case:
    def __init__(self, run: Run, name: str, n: int, k: int) -> None:
        self.name, self.qtype, self.n, self.k = name, GGML_TYPES[name], n, k
        self.blocks = random_blocks(run, name, n, k)
        count = 1 if run.smoke else max(1, min(64, math.ceil(L2_MISS_BYTES /
                                                             self.blocks.numel())))
        self.copies = [self.blocks] + [self.blocks.clone() for _ in range(count - 1)]
        # qint holds Q6_K in aligned rows (kernels/qint.py's Q6_K_A)
        self.kind = qint.ACT8_STORED[self.qtype]
        self.held = [qint.repack_q6k(b, k) if self.kind == qint.Q6_K_A else b
                     for b in self.copies]
        self.x = torch.randn(max(MS) if run.smoke else 512, k, device=run.dev,
                             generator=run.gen).bfloat16()
        w = dequantize_reference(self.blocks.view(-1), self.qtype, (n, k), torch.float64)
        self.bound16 = self.x.double().abs() @ w.abs().T
        self.ref16 = self.x.double() @ w.T
        xq = dequantized_x_reference(self.x)
        self.ref, self.bound = xq @ w.T, xq.abs() @ w.abs().T
        del w
        self.row0: dict = {}


def measure(run: Run, case: Case, mode: str, m: int, cfg: QIntConfig | None, ceil: dict) -> dict:
    row = {"type": case.name, "n": case.n, "k": case.k, "m": m, "mode": mode,
           "config": None if cfg is None else list(cfg), "ok": False}
    what = f"{case.name} ({case.n},{case.k}) M={m} {mode} {cfg}"
    x = case.x[:m]
    if mode == "qmatmul":
        call = partial(qmatmul_triton, x, ggml_type=case.qtype, shape=(case.n, case.k))
        weights = case.copies
    else:
        call = partial(qint_triton, x, ggml_type=case.kind, shape=(case.n, case.k),
                       config=cfg)
        weights = case.held
    y = run.attempt(what, lambda: call(blocks=weights[0]))
    if y is None:
        return row
    if mode == "qmatmul":
        err = float(((y.double() - case.ref16[:m]).abs() / case.bound16[:m]).max())
        row.update(err=err, ok=bool(torch.isfinite(y).all()) and err <= 2**-7)
    else:
        err = float(((y.double() - case.ref[:m]).abs() / case.bound[:m]).max())
        row.update(err=err, ok=bool(torch.isfinite(y).all()) and err <= 2**-16)
        split = default_qint_config(case.qtype, case.n, case.k, run.sms, m=m).split
        if cfg is None or cfg.split == split:  # the default split: row 0's bits as at M = 1
            first = case.row0.setdefault("m1", y[0].clone())
            row["bits_equal_m1"] = bool(torch.equal(y[0], first))
    if run.warm:
        weights = weights[:1] * 32
    us = run.attempt(what, lambda: run.time_us([partial(call, blocks=w) for w in weights]))
    if us is not None:
        gbs = case.blocks.numel() / us / 1e3
        row.update(us=us, gb_s=gbs, pct_copy=100 * gbs / ceil["copy_gb_s"])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--types", default="Q4_K,Q6_K")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    ap.add_argument("--sweep-shapes", default="4096x4096,14336x4096",
                    help="shapes swept at M = 1 (NxK, comma separated)")
    ap.add_argument("--tile-sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="time TILE_SWEEP's matrix-unit tiles on the swept shapes")
    ap.add_argument("--tiles", default="",
                    help="time these matrix-unit tiles instead of TILE_SWEEP, at 16 and 32 "
                         "rows: 'bm,bn,warps[,stages[,max_regs]];...' (an empty field: "
                         "unset), e.g. '16,64,4,,120;16,128,8'")
    ap.add_argument("--in-cta-sweep", action="store_true",
                    help="time one-row programs that take every split of their rows "
                         "(32-128 rows, 1-8 warps) on the swept shapes")
    ap.add_argument("--splits", default="",
                    help="also time qint at 1, 16 and 32 rows with these K splits (e.g. "
                         "1,2,4,7,8,14) on the swept shapes: the split's own cost")
    ap.add_argument("--shapes", default="",
                    help="only these of the model's shapes (NxK, comma separated)")
    ap.add_argument("--rows", default="", help="only these rows of x (comma separated)")
    ap.add_argument("--qmatmul", action=argparse.BooleanOptionalAction, default=True,
                    help="also time qmatmul's kernel at each shape and row count")
    ap.add_argument("--config-sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="sweep the CUDA-core kernel's configs at one row on the swept shapes")
    ap.add_argument("--regs", default="",
                    help="the config sweep's register caps besides none (e.g. 96,128)")
    ap.add_argument("--other-way", action="store_true",
                    help="also time each CUDA-core launch with its splits the other way: in "
                         "one program or as programs of their own (kernels.qint.other_way)")
    ap.add_argument("--warm", action="store_true",
                    help="time over one weight copy (L2-resident where it fits) instead of "
                         "copies that miss the L2")
    ap.add_argument("--tiles-only", action="store_true",
                    help="sweep the matrix-unit kernel's tiles only (not the CUDA-core configs)")
    args = ap.parse_args(argv)
    run = Run(args)
    run.warm = args.warm
    shapes = [(32, 512)] if args.smoke else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = (1, 3) if args.smoke else MS
    if args.rows:
        ms = tuple(int(v) for v in args.rows.split(","))
    ceil = ceilings(run)
    out = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(), "ceilings": ceil,
           "commit": commit_id(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
           "rows": [], "versions": [torch.__version__, __import__("triton").__version__]}
    swept = {tuple(int(v) for v in s.split("x")) for s in args.sweep_shapes.split(",") if s}
    for name in args.types.split(","):
        for n, k in shapes:
            if run.left() < 20:
                out.setdefault("skipped", []).append(f"{name} ({n},{k})")
                continue
            case = Case(run, name, n, k)
            for m in ms:
                for mode in ("qmatmul", "qint") if args.qmatmul else ("qint",):
                    out["rows"].append(measure(run, case, mode, m, None, ceil))
                cfg = default_qint_config(case.qtype, n, k, run.sms, m=m)
                if args.other_way and m <= qint.gemv_max_m(case.kind) and cfg.split > 1:
                    row = measure(run, case, "qint", m, qint.other_way(cfg), ceil)
                    row.update(mode="qint-other")
                    out["rows"].append(row)
            if ((n, k) in swept or args.smoke) and args.config_sweep and not args.tiles_only:
                base = default_qint_config(case.qtype, n, k, run.sms)
                regs = (None, *(int(v) for v in args.regs.split(",") if v))
                for cfg in sweep(base, regs)[:2 if args.smoke else None]:
                    if run.left() > 60:
                        out["rows"].append(measure(run, case, "qint", 1, cfg, ceil))
            if (n, k) in swept and not args.smoke and not args.tiles_only:
                # the CUDA-core kernel at 3-4 rows under register caps (3 programs of 4
                # warps a multiprocessor at 168, 2 without: its wide build takes 202-206)
                base = default_qint_config(case.qtype, n, k, run.sms, m=4)
                for regs in (168, 128):
                    for m in (3, 4):
                        out["rows"].append(measure(run, case, "qint", m,
                                                   base._replace(max_regs=regs), ceil))
            if args.in_cta_sweep and (n, k) in swept:
                base = default_qint_config(case.qtype, n, k, run.sms)
                for cfg in in_cta_sweep(base):
                    if run.left() > 30:
                        row = measure(run, case, "qint", 1, cfg, ceil)
                        row.update(mode="qint-cta")
                        out["rows"].append(row)
            for split in (int(v) for v in args.splits.split(",") if v):
                if (n, k) in swept and (k // 256) % split == 0:
                    for m in (1, 16, 32):
                        cfg = default_qint_config(case.qtype, n, k, run.sms, m=m)
                        row = measure(run, case, "qint", m, cfg._replace(split=split), ceil)
                        row.update(mode="qint-split")
                        out["rows"].append(row)
            if (n, k) in swept and not args.smoke and args.tile_sweep:  # matrix-unit tiles
                for tile, tile_ms in parse_tiles(args.tiles) or TILE_SWEEP:
                    with qint_mm.forced_tile(tile):
                        for m in tile_ms:
                            row = measure(run, case, "qint", m, None, ceil)
                            row.update(mode="qint-tile", tile=list(tile))
                            out["rows"].append(row)
            print(f"{name} ({n},{k}) done, {run.left():.0f} s left", flush=True)
            del case
            if not args.smoke:
                torch.cuda.empty_cache()
    out["errors"] = run.out["errors"]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qint_bench.json").write_text(json.dumps(out, indent=1))
    print(f"{out['device']}: copy {ceil['copy_gb_s']:.0f} GB/s")
    print(f"{'type':5} {'N':>6} {'K':>5} {'M':>3} {'mode':7} {'us':>8} {'GB/s':>6} {'%cp':>4} "
          f"{'err':>8} ok bits config")
    for r in out["rows"]:
        if r.get("us"):
            print(f"{r['type']:5} {r['n']:6} {r['k']:5} {r['m']:3} {r['mode']:7} {r['us']:8.1f} "
                  f"{r['gb_s']:6.0f} {r['pct_copy']:4.0f} {r['err']:8.1e} {int(r['ok'])}  "
                  f"{r.get('bits_equal_m1', '-')!s:5} {r['config'] or r.get('tile') or 'default'}")
    bad = [r for r in out["rows"] if not r["ok"] or r.get("bits_equal_m1") is False]
    print(f"failures: {len(bad)}; errors: {len(out['errors'])}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
