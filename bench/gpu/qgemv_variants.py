"""qmatmul's kernels against an earlier version of them on the GPU, at Llama-3.1-8B's
shapes: correctness, batch invariance, bandwidth, and a config sweep.

    python3 bench/gpu/qgemv_variants.py --old-src DIR   # on the device machine, ~3 minutes

Variants, each at its default launch config: `old` (the kernels in DIR: qmatmul.py,
qtiles.py, qgemv.py of an earlier commit) and `new` (this tree's); then a small config
sweep of the new skinny kernel at M = 1. Every
run is checked against the float64 product of kernels.dequant's reference (within
2^-7 |x| |W|); per mode, row 0 of M = 1, M = 16 (skinny) and M = 64, 512 (tiled) must be
bit-equal (batch invariance). Times are CUDA-graph replays over weight copies that miss
the L2 (bench/gpu/qmatmul_bench.py's method); GB/s counts the GGML bytes. Writes
$OUT/qgemv_variants.json and prints a table.
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
from qmatmul_bench import L2_MISS_BYTES, Run, ceilings, load_old  # noqa: E402

from kernels import qgemv  # noqa: E402
from kernels.dequant import dequantize_reference  # noqa: E402
from kernels.qmatmul import QMMConfig, _lut, qmatmul_tiled  # noqa: E402

SHAPES = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
PREFILL_SHAPES = [(4096, 4096), (14336, 4096)]


def sweep(cfg: QMMConfig) -> list[QMMConfig]:
    """A few skinny configs around the default (same split; on the GPU block_k does not
    change a row's bits, see kernels/qgemv.py)."""
    out = [cfg._replace(block_n=bn, num_warps=w, num_stages=st)
           for bn in (64, 128) for w in (4, 8) for st in (1, 2)]
    out += [c._replace(block_k=128) for c in out[:4] if cfg.block_k == 256]
    return [c for c in dict.fromkeys(out) if c != cfg]


class Case:
    def __init__(self, run: Run, name: str, n: int, k: int, m_max: int) -> None:
        self.name, self.qtype, self.n, self.k = name, GGML_TYPES[name], n, k
        self.blocks = random_blocks(run, name, n, k)
        count = max(1, min(64, math.ceil(L2_MISS_BYTES / self.blocks.numel())))
        self.copies = [self.blocks] + [self.blocks.clone() for _ in range(count - 1)]
        self.x = torch.randn(m_max, k, device=run.dev, generator=run.gen).bfloat16()
        w = dequantize_reference(self.blocks.view(-1), self.qtype, (n, k), torch.float64)
        self.ref, self.bound = self.x.double() @ w.T, self.x.double().abs() @ w.abs().T
        self.lut = _lut(self.qtype, run.dev)

    def call(self, mode: str, m: int, cfg: QMMConfig | None, old, sms: int):
        x = self.x[:m]
        if mode == "old":
            return partial(old.qmatmul_triton, x, ggml_type=self.qtype, shape=(self.n, self.k))
        cfg = cfg or qgemv.default_config(self.qtype, m, self.n, self.k, num_sms=sms)
        if m <= qgemv.SKINNY_MAX_M:
            return partial(qgemv.qgemv_triton, x, ggml_type=self.qtype, n=self.n, lut=self.lut,
                           cfg=cfg)
        return partial(qmatmul_tiled, x, ggml_type=self.qtype, n=self.n, lut=self.lut, cfg=cfg,
                       num_sms=sms)


def measure(run: Run, case: Case, mode: str, m: int, cfg: QMMConfig | None, old, sms: int,
            ceil: dict, row0: dict) -> dict:
    row = {"type": case.name, "n": case.n, "k": case.k, "m": m, "mode": mode,
           "config": None if cfg is None else list(cfg), "ok": False}
    what = f"{case.name} ({case.n},{case.k}) M={m} {mode} {cfg}"
    call = case.call(mode, m, cfg, old, sms)
    y = run.attempt(what, lambda: call(blocks=case.blocks))
    if y is None:
        return row
    err = float(((y.double() - case.ref[:m]).abs() / case.bound[:m]).max())
    row.update(err=err, ok=bool(torch.isfinite(y).all()) and err <= 2**-7)
    if cfg is None:  # default configs: row 0 against the mode's M = 1 row 0
        first = row0.setdefault((case.name, case.n, case.k, mode), y[0].clone())
        row["bits_equal_m1"] = bool(torch.equal(y[0], first))
    us = run.attempt(what, lambda: run.time_us([partial(call, blocks=w) for w in case.copies]))
    if us is not None:
        gbs = case.blocks.numel() / us / 1e3
        row.update(us=us, gb_s=gbs, pct_copy=100 * gbs / ceil["copy_gb_s"],
                   tflop_s=2 * m * case.n * case.k / us / 1e6)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--old-src", help="folder with an earlier qmatmul.py, qtiles.py, qgemv.py")
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0")
    ap.add_argument("--budget-s", type=float, default=240.0)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    ap.add_argument("--no-sweep", action="store_true", help="default configs only")
    args = ap.parse_args(argv)
    args.old_rev = "HEAD"
    run = Run(args)
    sms = 0 if args.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    shapes, prefill = ([(64, 256)], [(64, 256)]) if args.smoke else (SHAPES, PREFILL_SHAPES)
    old = run.attempt("old kernel", lambda: load_old(args)) if args.old_src else None
    ceil = ceilings(run)
    out = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(), "ceilings": ceil,
           "commit": commit_id(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
           "rows": [],
           "versions": [torch.__version__, __import__("triton").__version__]}
    row0: dict = {}
    modes = (["old"] if old else []) + ["new"]
    for name in args.types.split(","):
        for n, k in shapes:
            if run.left() < 15:
                out.setdefault("skipped", []).append(f"{name} ({n},{k})")
                continue
            ms = (1, 16, 64) + ((512,) if (n, k) in prefill else ())
            case = Case(run, name, n, k, max(ms))
            for m in ms:
                for mode in modes:
                    out["rows"].append(measure(run, case, mode, m, None, old, sms, ceil, row0))
            if name in ("Q4_K", "Q6_K") and not args.no_sweep:
                base = qgemv.default_config(case.qtype, 1, n, k, num_sms=sms)
                for cfg in sweep(base)[:1 if args.smoke else None]:
                    if run.left() > 60:  # the other shapes' defaults first
                        out["rows"].append(measure(run, case, "new", 1, cfg, old, sms, ceil,
                                                   row0))
            print(f"{name} ({n},{k}) done, {run.left():.0f} s left", flush=True)
            del case
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "qgemv_variants.json").write_text(json.dumps(out, indent=1))
    print(f"{out['device']}: copy {ceil['copy_gb_s']:.0f} GB/s")
    print(f"{'type':5} {'N':>6} {'K':>5} {'M':>4} {'mode':5} {'us':>8} {'GB/s':>6} {'%cp':>4} "
          f"{'TF/s':>6} {'err':>8} ok bits config")
    for r in out["rows"]:
        if r.get("us"):
            print(f"{r['type']:5} {r['n']:6} {r['k']:5} {r['m']:4} {r['mode']:5} {r['us']:8.1f} "
                  f"{r['gb_s']:6.0f} {r['pct_copy']:4.0f} {r['tflop_s']:6.1f} {r['err']:8.1e} "
                  f"{int(r['ok'])}  {r.get('bits_equal_m1', '-')!s:5} {r['config'] or 'default'}")
    bad = [r for r in out["rows"] if not r["ok"] or r.get("bits_equal_m1") is False]
    print(f"failures (wrong or bits differ from M=1): {len(bad)}; errors: "
          f"{len(run.out.get('errors', []))}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
