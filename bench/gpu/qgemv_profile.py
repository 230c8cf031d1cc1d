"""One qmatmul launch shape, run repeatedly, for a profiler (Nsight Compute) to read.

    ncu --clock-control none -k regex:_qgemv --launch-skip 3 --launch-count 1 \
        python3 bench/gpu/qgemv_profile.py --type Q4_K --n 14336 --k 4096 --m 1

Random blocks (finite f16 scales) and bf16 x; the launch config is qmatmul's default
unless given (`--cfg block_m,block_n,block_k,split_k,num_warps,num_stages`). Prints the
mean time of `--reps` graph-free launches, so that a run without the profiler is a
rough timing too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
from kernels_check import GGML_TYPES, random_blocks  # noqa: E402
from qmatmul_bench import Run  # noqa: E402

from kernels import qgemv  # noqa: E402
from kernels.qmatmul import QMMConfig, _lut, qmatmul_tiled  # noqa: E402


def shape_parser(doc: str, types: list[str], cfg_help: str) -> argparse.ArgumentParser:
    """One launch shape's options: --type --n --k --m --reps --cfg."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--type", default="Q4_K", choices=types)
    ap.add_argument("--n", type=int, default=14336)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--m", type=int, default=1)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--cfg", help=cfg_help)
    return ap


def launch_us(call, reps: int) -> float:
    """Mean us of `reps` launches of `call` after 3 warm-ups (no graph: a profiler sees
    each launch)."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main(argv: list[str] | None = None) -> int:
    args = shape_parser(__doc__, sorted(GGML_TYPES),
                        "block_m,block_n,block_k,split_k,num_warps,num_stages").parse_args(argv)
    run = Run(argparse.Namespace(smoke=False, budget_s=60.0))
    qtype = GGML_TYPES[args.type]
    blocks = random_blocks(run, args.type, args.n, args.k)
    x = torch.randn(args.m, args.k, device=run.dev, generator=run.gen).bfloat16()
    if args.cfg:
        f = [int(v) for v in args.cfg.split(",")]
        cfg = QMMConfig(*f[:5], f[5] if len(f) > 5 and f[5] > 0 else None)
    else:
        cfg = qgemv.default_config(qtype, args.m, args.n, args.k, num_sms=run.sms)
    lut = _lut(qtype, run.dev)
    if args.m <= qgemv.SKINNY_MAX_M:
        def call():
            return qgemv.qgemv_triton(x, blocks, qtype, args.n, lut, cfg)
    else:
        def call():
            return qmatmul_tiled(x, blocks, qtype, args.n, lut, cfg, num_sms=run.sms)
    us = launch_us(call, args.reps)
    print(f"{args.type} ({args.n},{args.k}) M={args.m} {cfg}: {us:.1f} us, "
          f"{blocks.numel() / us / 1e3:.0f} GB/s (L2-warm launches)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
