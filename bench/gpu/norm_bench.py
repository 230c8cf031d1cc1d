"""kernels/fused_norm.py's add + RMSNorm + 8-bit quantization (the q8 layout's norm before
each linear; 65 launches a decode step of Llama-3.1-8B) on 4, 8 or 16 warps.

    python3 bench/gpu/norm_bench.py [--out DIR]

Each config is checked against the torch reference (y within 2^-20 relative, the codes
those of its own y) and timed as a CUDA graph of 200 launches in one stream (qmatmul_bench's
Run.time_us), plain and as programmatic dependent launches (the engine's decode graphs),
at 1 and 16 rows.
Writes $OUT/norm_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import Run  # noqa: E402

from kernels import fused_norm  # noqa: E402
from kernels.quant_x import empty_quant_x, quant_x_reference  # noqa: E402
from kernels.triton_util import launcher  # noqa: E402

DIM = 4096
LAUNCHES = 200


def launch(x, r, w, h, y, xq, warps: int, pdl: bool) -> None:
    kernel = launcher(fused_norm._add_rms_norm_kernel, x.device) if pdl else \
        fused_norm._add_rms_norm_kernel
    kernel[(x.shape[0],)](x, r, w, w, h, y, *xq, x, x, x.stride(0), r.stride(0),
                          h.stride(0), y.stride(0), DIM, 1e-5, HAS_RESIDUAL=True,
                          HAS_RES_NORM=False, BLOCK_D=DIM, QUANT=True, num_warps=warps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    run = Run(argparse.Namespace(smoke=False, budget_s=600.0))
    dev = torch.device("cuda")
    out: dict = {"device": torch.cuda.get_device_name(), "commit": commit_id(),
                 "date": datetime.now(UTC).isoformat(timespec="seconds"), "rows": []}
    gen = torch.Generator(dev).manual_seed(0)
    for rows in (1, 16):
        x = torch.randn(rows, DIM, device=dev, generator=gen)
        r = torch.randn(rows, DIM, device=dev, generator=gen)
        w = torch.rand(DIM, device=dev, generator=gen) + 0.5
        ref = fused_norm.add_rms_norm_reference(x, w, 1e-5, r, None, torch.float32, True)
        for warps in (4, 8, 16):
            h, y = torch.empty_like(x), torch.full_like(x, float("nan"))
            xq = empty_quant_x(rows, DIM, dev)
            launch(x, r, w, h, y, xq, warps, False)
            own = quant_x_reference(y)
            rel = float(((y - ref.y).abs() / ref.y.abs().clamp_min(1e-30)).max())
            row = {"rows": rows, "warps": warps, "y_rel_err": rel,
                   "ok": rel <= 2**-20 and torch.equal(h, ref.h)
                   and torch.equal(xq.q, own.q) and torch.equal(xq.dx, own.dx)}
            for pdl in (False, True):
                call = partial(launch, x, r, w, h, y, xq, warps, pdl)
                row["pdl_us" if pdl else "plain_us"] = round(run.time_us([call] * LAUNCHES), 3)
            out["rows"].append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "norm_bench.json").write_text(json.dumps(out, indent=1))
    return 0 if all(r["ok"] for r in out["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
