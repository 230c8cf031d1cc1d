"""One Gluon Q4_K launch shape (kernels/qint_mma.py), run repeatedly, for a profiler.

    ncu --clock-control none -k regex:_qint --launch-skip 3 --launch-count 1 \\
        python3 bench/gpu/qint_mma_profile.py --n 28672 --k 4096 --variant 4,2

--variant: warps, stages; `--qint` launches qint's own matrix-unit kernel (its default
16-row tile) instead.
Random blocks, 16 rows of x quantized once, qint's default split. Prints the mean time of
`--reps` graph-free launches (a rough timing without the profiler).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
from kernels_check import random_blocks  # noqa: E402
from qmatmul_bench import Run  # noqa: E402

from kernels import qint, qint_mm, qint_mma, quant_x  # noqa: E402
from kernels.qgemv import _tickets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=28672)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--variant", default="4,2")
    ap.add_argument("--qint", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    run = Run(argparse.Namespace(smoke=False, budget_s=60.0))
    blocks = random_blocks(run, "Q4_K", args.n, args.k)
    x = torch.randn(args.m, args.k, device=run.dev, generator=run.gen)
    xq = quant_x.quantize_x(x)
    split = qint.default_qint_config(qint.Q4_K, args.n, args.k, run.sms, m=args.m).split
    warps, stages = (int(v) for v in args.variant.split(","))
    if args.qint:
        def call():
            with qint_mm.forced_tile(qint_mm.TILE_CANDIDATES["cuda"][16][0]):
                return qint.qint_triton(x, blocks, qint.Q4_K, (args.n, args.k), xq=xq)
    else:
        def call():
            return qint_mma.qint_mma_launch(xq, blocks, args.n, args.k, split,
                                            _tickets(run.dev), warps=warps, stages=stages)
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.reps):
        call()
    torch.cuda.synchronize()
    us = (time.perf_counter() - start) / args.reps * 1e6
    print(f"Q4_K ({args.n},{args.k}) M={args.m} split {split} "
          f"{'qint' if args.qint else args.variant}: {us:.1f} us (L2-warm launches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
