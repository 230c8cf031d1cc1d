"""One qint launch shape, run repeatedly, for a profiler (Nsight Compute) to read.

    ncu --clock-control none -k regex:_qint --launch-skip 3 --launch-count 1 \
        python3 bench/gpu/qint_profile.py --type Q4_K --n 14336 --k 4096 --m 1

Random blocks (finite f16 scales; Q6_K repacked to Q6_K_A as the q8 layout holds it) and
x quantized once; the config is qint's default unless given (`--cfg
block_n,split,num_warps`). Prints the mean time of `--reps` graph-free launches, so that
a run without the profiler is a rough timing too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
from kernels_check import GGML_TYPES, random_blocks  # noqa: E402
from qgemv_profile import launch_us, shape_parser  # noqa: E402
from qmatmul_bench import Run  # noqa: E402

from kernels import qint, quant_x  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = shape_parser(__doc__, ["Q4_K", "Q6_K"], "block_n,split,num_warps").parse_args(argv)
    run = Run(argparse.Namespace(smoke=False, budget_s=60.0))
    blocks = random_blocks(run, args.type, args.n, args.k)
    qtype = qint.ACT8_STORED[GGML_TYPES[args.type]]
    if qtype == qint.Q6_K_A:
        blocks = qint.repack_q6k(blocks, args.k)
    x = torch.randn(args.m, args.k, device=run.dev, generator=run.gen)
    xq = quant_x.quantize_x(x)
    cfg = qint.QIntConfig(*(int(v) for v in args.cfg.split(","))) if args.cfg else None

    def call():
        return qint.qint_triton(x, blocks, qtype, (args.n, args.k), cfg, xq=xq)

    us = launch_us(call, args.reps)
    used = cfg or qint.default_qint_config(qtype, args.n, args.k, run.sms)
    print(f"{args.type} ({args.n},{args.k}) M={args.m} {used}: {us:.1f} us, "
          f"{blocks.numel() / us / 1e3:.0f} GB/s (L2-warm launches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
