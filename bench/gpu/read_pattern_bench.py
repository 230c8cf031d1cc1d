"""How fast the memory system serves the CUDA-core Q4_K product's reads, without its
arithmetic: the same grid, programs and loads as kernels/qint.py's one-row kernel (64 rows
on 2 warps, one super-block of each row a step: its 16-byte head and 128 bytes of codes),
summed instead of multiplied, in two layouts of the same bytes:

- `rows`: GGUF's, as the engine holds Q4_K (a step reads 144 bytes of each of 64 rows,
  a row's bytes apart);
- `tiles`: the 64 rows of a program's tile super-block by super-block (a step reads 9216
  contiguous bytes; what a load-time repack would give).

And as the engine runs them at one row on NVIDIA (`QIntConfig.in_cta`: a program's 64
rows are the S splits of 64 / S weight rows, each split its own range of super-blocks):

- `cta_rows`: in GGUF's layout (a step reads super-block s * (K / 256 / S) + i of each
  (weight row, split s), 144 bytes each);
- `cta_steps`: the same super-blocks laid out so that each step of each program reads
  9216 contiguous bytes (a repack for that config alone).

    python3 bench/gpu/read_pattern_bench.py [--out DIR]

Also a plain contiguous read (the read ceiling) and the copy ceiling of qmatmul_bench,
timed the same way (CUDA-graph replays over weight copies that miss the L2). If `tiles`
reads much faster than `rows`, a tiled repack of the weights is worth its cost in the
kernels; if both read near the ceiling, the kernel's own latency is what bounds it.
Writes $OUT/read_pattern_bench.json.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import L2_MISS_BYTES, Run, ceilings  # noqa: E402

from kernels import qint  # noqa: E402
from kernels.triton_util import jit, tl  # noqa: E402

SHAPES = [(4096, 4096), (6144, 4096), (28672, 4096), (14336, 4096), (4096, 14336)]


@jit
def _read_sbs(w_ptr, out_ptr, N, K, row_bytes, sb_per_split, nsplit,
              BLOCK_N: tl.constexpr, TILES: tl.constexpr, IN_CTA: tl.constexpr = 0):
    """Xors the words qint's Q4_K program (pid_n, split) reads, super-block by super-block.
    IN_CTA (S > 0): grid (N / (BLOCK_N / S), 1), row v of the program split v % S of weight
    row v // S (the `cta_` patterns)."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.arange(0, BLOCK_N)[:, None]
    c = tl.arange(0, 32)[None, :]
    h = tl.arange(0, 4)[None, :]
    w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros((BLOCK_N, 32), tl.int32)
    hacc = tl.zeros((BLOCK_N, 4), tl.int32)
    nsb = K // 256
    for i in range(0, sb_per_split):
        if IN_CTA > 0:
            if TILES:  # step i of program pid_n: its BLOCK_N super-blocks one after another
                base = ((pid_n * sb_per_split + i) * BLOCK_N + r).to(tl.int64) * 36
            else:
                wrow = pid_n * (BLOCK_N // IN_CTA) + r // IN_CTA
                sb = (r % IN_CTA) * sb_per_split + i
                base = wrow.to(tl.int64) * (row_bytes // 4) + sb * 36
        else:
            sb = split * sb_per_split + i
            if TILES:
                base = ((pid_n * nsb + sb) * BLOCK_N + r).to(tl.int64) * 36
            else:
                base = (pid_n * BLOCK_N + r).to(tl.int64) * (row_bytes // 4) + sb * 36
        hacc ^= tl.load(w32 + base + h)
        acc ^= tl.load(w32 + base + 4 + c)
    total = tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0) ^ tl.xor_sum(tl.xor_sum(hacc, axis=1),
                                                                   axis=0)
    tl.store(out_ptr + pid_n * nsplit + split, total)


@jit
def _read_flat(w_ptr, out_ptr, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """Xors STEPS contiguous blocks of BLOCK int32 words a program (the read ceiling)."""
    pid = tl.program_id(0)
    w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    acc = tl.zeros((BLOCK,), tl.int32)
    for i in range(0, STEPS):
        offs = (pid * STEPS + i).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(w32 + offs, mask=offs < n_words, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def _xor(t: torch.Tensor) -> int:
    return int(np.bitwise_xor.reduce(t.cpu().numpy()))


def _measure(run: Run, copies: list[torch.Tensor], copy_gb_s: float, row: dict,
             totals: dict[str, int], name: str, call, out: torch.Tensor) -> None:
    """row[name]: a read pattern's time over the weight copies (`call(copy)` writes its
    xors into `out`), against the copy ceiling; its xor of the first copy into totals."""
    call(copies[0])
    totals[name] = _xor(out)
    us = run.time_us([partial(call, b) for b in copies])
    nbytes = copies[0].numel()
    row[name] = {"us": round(us, 2), "gb_s": round(nbytes / us / 1e3),
                 "pct_copy": round(100 * nbytes / us / 1e3 / copy_gb_s, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=120.0)
    ap.add_argument("--warps", default="2,4")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:  # the interpreter on the CPU (TRITON_INTERPRET=1)
        from kernels.triton_util import _fix_scalar_index

        _fix_scalar_index()
    run = Run(args)
    out = run.out
    out.update({"device": torch.cuda.get_device_name() if not args.smoke else "cpu",
                "commit": commit_id(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "ceilings": ceilings(run)})
    copy = out["ceilings"]["copy_gb_s"]
    print(f"copy ceiling {copy:.0f} GB/s", flush=True)
    for n, k in [(128, 1024)] if args.smoke else SHAPES:
        if run.left() < 10:
            out["skipped"].append(f"{n}x{k}")
            continue
        nbytes = n * k // 256 * 144
        copies = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=run.dev,
                                generator=run.gen)
                  for _ in range(max(2, math.ceil(L2_MISS_BYTES / nbytes)))]
        # the smoke run as on one multiprocessor: its shape splits in two
        split = qint.default_qint_config(qint.Q4_K, n, k, run.sms or 1, m=1).split
        sums = torch.empty(n // 64 * split, dtype=torch.int32, device=run.dev)
        row = {"n": n, "k": k, "split": split, "mb": nbytes / 1e6}
        # every pattern reads each word once: their xors agree with numpy's
        want = _xor(copies[0].view(torch.int32))
        totals: dict[str, int] = {}
        measure = partial(_measure, run, copies, copy, row, totals)

        for warps in (int(w) for w in args.warps.split(",")):
            for tiles in (False, True):
                measure(f"{'tiles' if tiles else 'rows'}_w{warps}",
                        partial(_read_sbs[(n // 64, split)], out_ptr=sums, N=n, K=k,
                                row_bytes=k // 256 * 144, sb_per_split=k // 256 // split,
                                nsplit=split, BLOCK_N=64, TILES=tiles, num_warps=warps), sums)
                if split == 1:
                    continue
                tile = 64 // split  # weight rows a program (qint.in_cta_config)
                cta = torch.empty(n // tile, dtype=torch.int32, device=run.dev)
                measure(f"{'cta_steps' if tiles else 'cta_rows'}_w{warps}",
                        partial(_read_sbs[(n // tile, 1)], out_ptr=cta, N=n, K=k,
                                row_bytes=k // 256 * 144, sb_per_split=k // 256 // split,
                                nsplit=1, BLOCK_N=64, TILES=tiles, IN_CTA=split,
                                num_warps=warps), cta)
        words = nbytes // 4
        for block, steps in ((2048, 8), (1024, 4)):
            grid = -(-words // (block * steps))
            part = torch.empty(grid, dtype=torch.int32, device=run.dev)
            measure(f"flat_{block}x{steps}",
                    partial(_read_flat[(grid,)], out_ptr=part, n_words=words, BLOCK=block,
                            STEPS=steps, num_warps=4), part)
        row["sums_agree"] = all(t == want for t in totals.values())
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        del copies
    (Path(args.out) / "read_pattern_bench.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
