"""How fast one launch could read a Llama MLP's weights at one row if each program owned a
slice of the FFN: the reads of a fused gate|up + activation + down kernel, without its
arithmetic, against the same bytes read flat and against two launches.

Program p owns FFN columns [p F, (p + 1) F): it reads its F gate rows and F up rows of the
Q4_K gate|up matrix (every super-block of each), then the F columns of every one of the
HIDDEN down rows (Q4_K: the super-block's 16-byte head and the F / 8 words of codes of
those columns; Q6_K_A: F / 8 words of ql, F / 16 of qh and the 4 scale words), and writes
one int32 a down row (the partial a fused kernel would write, HIDDEN x 4 bytes a program).
With F = 256 every byte is read once; with less, a down super-block's head (or scales) is
read by each of its 256 / F programs. A fused kernel would need no wait between gate|up and
down (each program's down slice needs only its own activations) and one launch instead of
three, but only FFN / F programs (56-224 at Llama-3.1-8B's 14336) and a sum of their
partials after it. If these reads come near the flat read's time, the fused kernel is worth
building; if not, its program count is what bounds it.

The fused kernel this prices can keep q8's bits (and so batch invariance): with F = 256 a
program holds a whole super-block of the activation (its quantization needs no other
program) and writes, for each down row, that super-block's exact integer sums (Q4_K: isum
and msum; Q6_K: isum); a reduce launch then replays each split's fma chain over its
super-blocks in K order and adds the splits in split order, as kernels/qint.py's one-row
product does. Its gate|up rows keep their own split's chains the same way. But F = 256 puts
the gate|up product's arithmetic on 56 programs: its one-row kernel issues ~7M warp
instructions on the H200 (~7 us of all 132 multiprocessors' issue at best), ~17 us on 56.
So reads near the flat time here are necessary for that kernel, not sufficient; at F = 64
(224 programs) the activation's super-block quantization would need other programs' values.

    python3 bench/gpu/mlp_read_bench.py [--out DIR] [--f 64,128,256] [--warps 4,8,16,32]

Timed as bench/gpu/qmatmul_bench.py times (CUDA-graph replays over weight copies that miss
the L2). Every variant's xor of what it read is checked against numpy's xor of the words it
must read an odd number of times. Writes $OUT/mlp_read_bench.json. --smoke: tiny shapes in
the interpreter (TRITON_INTERPRET=1).
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
from read_pattern_bench import _read_flat  # noqa: E402  (the read ceiling's kernel)

from kernels.triton_util import jit, tl  # noqa: E402

HIDDEN, FFN = 4096, 14336  # Llama-3.1-8B
SB_WORDS = {"Q4_K": 36, "Q6_K": 52}  # a super-block's record in int32 words (Q6_K_A: no d)
GU_CHUNK = 32  # gate (and up) rows a program reads a step
DOWN_CHUNK = 128  # down rows a program reads a step


@jit
def _read_mlp(gu_ptr, dn_ptr, gu_out, dn_out, ffn, hidden, dn_row_words,
              F: tl.constexpr, Q6: tl.constexpr, RCH: tl.constexpr, DCH: tl.constexpr):
    """Program p: xor of its F gate and F up rows (gu_out[p]) and, for each down row, of
    the words of its F columns (dn_out[p, row])."""
    p = tl.program_id(0)
    g32 = gu_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    d32 = dn_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    gu_words = hidden // 256 * 36
    c = tl.arange(0, 32)[None, :]
    h = tl.arange(0, 4)[None, :]
    acc = tl.zeros((RCH, 32), tl.int32)
    hacc = tl.zeros((RCH, 4), tl.int32)
    for r0 in range(0, F, RCH):
        r = (p * F + r0 + tl.arange(0, RCH))[:, None].to(tl.int64)
        for sb in range(0, hidden // 256):
            for part in tl.static_range(2):  # the gate row, then the up row
                base = (r + part * ffn) * gu_words + sb * 36
                hacc ^= tl.load(g32 + base + h)
                acc ^= tl.load(g32 + base + 4 + c)
    tl.store(gu_out + p, tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0)
             ^ tl.xor_sum(tl.xor_sum(hacc, axis=1), axis=0))
    col = p * F  # the slice's first FFN column
    sb = col // 256
    within = col % 256
    for d0 in range(0, hidden, DCH):
        rows = (d0 + tl.arange(0, DCH)).to(tl.int64)
        if Q6:
            base = rows[:, None] * dn_row_words + sb * 52
            a = tl.load(d32 + base + within // 8 + tl.arange(0, F // 8)[None, :])  # ql
            b = tl.load(d32 + base + 32 + within // 16 + tl.arange(0, F // 16)[None, :])  # qh
            s = tl.load(d32 + base + 48 + h)  # scales
            x = tl.xor_sum(a, axis=1) ^ tl.xor_sum(b, axis=1) ^ tl.xor_sum(s, axis=1)
        else:
            base = rows[:, None] * dn_row_words + sb * 36
            a = tl.load(d32 + base + 4 + within // 8 + tl.arange(0, F // 8)[None, :])  # codes
            s = tl.load(d32 + base + h)  # head
            x = tl.xor_sum(a, axis=1) ^ tl.xor_sum(s, axis=1)
        tl.store(dn_out + p * hidden + rows, x)


def _xor(a: np.ndarray) -> int:
    return int(np.bitwise_xor.reduce(a.reshape(-1)))


def expected_xor(gu: torch.Tensor, dn: torch.Tensor, qtype: str, f: int, hidden: int,
                 ffn: int) -> int:
    """numpy's xor of the words _read_mlp reads an odd number of times: every gate|up word,
    every down code word (ql and qh), and the down heads (scales) only where each is read
    once (f = 256; with less, 256 / f programs read each)."""
    g = gu.cpu().numpy().view(np.int32)
    d = dn.cpu().numpy().view(np.int32).reshape(hidden, -1)
    words = SB_WORDS[qtype]
    recs = d[:, : ffn // 256 * words].reshape(hidden, ffn // 256, words)
    total = _xor(g) ^ _xor(recs[:, :, 4:] if qtype == "Q4_K" else recs[:, :, :48])
    if f == 256:
        total ^= _xor(recs[:, :, :4] if qtype == "Q4_K" else recs[:, :, 48:])
    return total


def down_row_words(qtype: str, ffn: int) -> int:
    """A down row's int32 words: its super-blocks' records (Q6_K_A: then its f16 d's, one
    word per two, padded to 16 bytes as kernels/qint.py's repack_q6k pads)."""
    sbs = ffn // 256
    if qtype == "Q4_K":
        return sbs * 36
    return (sbs * 208 + -(-2 * sbs // 16) * 16) // 4


def _pct(nbytes: int, us: float | None, copy: float) -> float | None:
    return None if us is None else round(100 * nbytes / us / 1e3 / copy, 1)


def _group(calls: list) -> None:
    for call in calls:
        call()


def measure_type(run: Run, qtype: str, hidden: int, ffn: int, fs: list[int],
                 warps_list: list[int], copy: float) -> dict:
    """Every (F, warps) variant with `qtype` down weights, then the flat reads."""
    gu_bytes = 2 * ffn * hidden // 256 * 144
    dn_words = down_row_words(qtype, ffn)
    dn_bytes = hidden * dn_words * 4
    nbytes = gu_bytes + dn_bytes
    count = max(2, math.ceil(L2_MISS_BYTES / nbytes))
    gus = [torch.randint(0, 256, (gu_bytes,), dtype=torch.uint8, device=run.dev,
                         generator=run.gen) for _ in range(count)]
    dns = [torch.randint(0, 256, (dn_bytes,), dtype=torch.uint8, device=run.dev,
                         generator=run.gen) for _ in range(count)]
    row: dict = {"down": qtype, "mb": round(nbytes / 1e6, 2), "variants": {}}
    for f in fs:
        programs = ffn // f
        want = expected_xor(gus[0], dns[0], qtype, f, hidden, ffn)
        gu_out = torch.empty(programs, dtype=torch.int32, device=run.dev)
        dn_out = torch.empty(programs, hidden, dtype=torch.int32, device=run.dev)
        for warps in warps_list:
            what = f"{qtype} F={f} warps={warps}"
            if run.left() < 10:
                run.out["skipped"].append(what)
                continue
            call = partial(_read_mlp[(programs,)], gu_out=gu_out, dn_out=dn_out, ffn=ffn,
                           hidden=hidden, dn_row_words=dn_words, F=f, Q6=qtype == "Q6_K",
                           RCH=min(GU_CHUNK, f), DCH=DOWN_CHUNK, num_warps=warps)
            first = partial(call, gus[0], dns[0])
            if not run.attempt(what, lambda first=first: first() or True):
                continue
            got = _xor(gu_out.cpu().numpy()) ^ _xor(dn_out.cpu().numpy())
            calls = [partial(call, g, d) for g, d in zip(gus, dns, strict=True)]
            us = run.attempt(what, partial(run.time_us, calls))
            row["variants"][f"F{f}_w{warps}"] = {"programs": programs, "ok": got == want,
                                                  "us": None if us is None else round(us, 2),
                                                  "pct_copy": _pct(nbytes, us, copy)}
    # the same bytes flat: one launch over both (their ceiling), and two launches
    block, steps = 1024, 4
    for name in ("flat_one", "flat_two"):
        calls = []
        for g, d in zip(gus, dns, strict=True):
            group = []
            for buf in ([torch.cat([g, d])] if name == "flat_one" else [g, d]):
                words = buf.numel() // 4
                grid = -(-words // (block * steps))
                part = torch.empty(grid, dtype=torch.int32, device=run.dev)
                group.append(partial(_read_flat[(grid,)], buf, part, words, BLOCK=block,
                                     STEPS=steps, num_warps=4))
            calls.append(partial(_group, group))
        us = run.attempt(name, partial(run.time_us, calls))
        row[name] = {"us": None if us is None else round(us, 2),
                     "pct_copy": _pct(nbytes, us, copy)}
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=150.0)
    ap.add_argument("--f", default="64,128,256", help="FFN columns a program")
    ap.add_argument("--warps", default="4,8,16,32")
    ap.add_argument("--types", default="Q4_K,Q6_K", help="the down matrix's type")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if args.smoke:  # the interpreter on the CPU (TRITON_INTERPRET=1)
        from kernels.triton_util import _fix_scalar_index

        _fix_scalar_index()
    hidden, ffn = (512, 1024) if args.smoke else (HIDDEN, FFN)
    fs = [int(v) for v in args.f.split(",")]
    if any(f not in (64, 128, 256) for f in fs):
        print("--f: 64, 128 or 256 FFN columns a program")
        return 1
    run = Run(args)
    out = run.out
    out.update({"device": torch.cuda.get_device_name() if not args.smoke else "cpu",
                "commit": commit_id(), "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "hidden": hidden, "ffn": ffn, "ceilings": ceilings(run)})
    copy = out["ceilings"]["copy_gb_s"]
    print(f"copy ceiling {copy:.0f} GB/s", flush=True)
    for qtype in args.types.split(","):
        row = measure_type(run, qtype, hidden, ffn, fs,
                           [int(w) for w in args.warps.split(",")], copy)
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "mlp_read_bench.json").write_text(json.dumps(out, indent=1))
    bad = [(r["down"], k) for r in out["rows"] for k, v in r["variants"].items() if not v["ok"]]
    print(f"wrong sums: {bad or 'none'}; errors: {len(out['errors'])}")
    return 1 if bad or out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
