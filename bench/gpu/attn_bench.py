"""Paged attention on decode rows (one new token a row) or prefill chunks under several
kernel configs: correctness against the float64 reference, then microseconds a launch.

    python3 bench/gpu/attn_bench.py [--rows 1,16,64] [--contexts 96,1024,4096]
        [--kv f16,q8] [--configs 64x64x256,16x128x256:8] [--chunk 1] [--fill 0,33]
        [--budget-s 300]

A config is BLOCK_Mx BLOCK_N x split keys, optionally `:warps` and `:warps:stages`. Each
case is Llama-3.1-8B's attention shape (32 heads, 8 KV heads, head dim 128, 16-token pages
in shuffled order); each row holds `context` tokens and queries its last `chunk` (a
prefill chunk's: take a 64x64 config). `--fill`: plan_attention's fill values to time
(0: a chunk's query blocks keep their whole keys; the engine's is 2 x multiprocessors /
8 KV heads, 33 on the H200). Times are CUDA graph replays of 32 launches over 8 layers'
planes (MBUFO_PDL=0: launches one after the other, as between a step's kernels). Writes
$OUT/attn_bench.json and prints a table; --smoke runs tiny shapes in the interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]
os.environ.setdefault("MBUFO_PDL", "0")

import torch  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import Run  # noqa: E402

from kernels.paged_attention import (  # noqa: E402
    AttnConfig,
    paged_attention,
    paged_attention_reference,
    plan_attention,
)

HEADS, KV_HEADS, DIM, PAGE, LAYERS, LAUNCHES = 32, 8, 128, 16, 8, 32


def parse_config(text: str) -> AttnConfig:
    """'64x64x256' or '16x128x256:8' or '16x128x256:4:2' -> AttnConfig."""
    shape, *rest = text.split(":")
    block_m, block_n, split = (int(v) for v in shape.split("x"))
    warps = int(rest[0]) if rest else 4
    stages = int(rest[1]) if len(rest) > 1 else None
    return AttnConfig(block_m, block_n, split, warps, stages)


def planes(fmt: str, slots: int, gen: torch.Generator, dev: torch.device) -> dict:
    if fmt == "f16":
        data = torch.randn(slots, KV_HEADS, DIM, generator=gen, device=dev) * 0.5
        return {"data": data.half()}
    codes = torch.randint(-127, 128, (slots, KV_HEADS, DIM), generator=gen, device=dev)
    scales = torch.rand(slots, KV_HEADS, DIM // 32, generator=gen, device=dev) * 0.01
    return {"codes": codes.to(torch.int8), "scales": scales.half()}


class Case:
    """`rows` rows of `context` tokens each querying their last `chunk`, K and V in `fmt`,
    LAYERS copies."""

    def __init__(self, run: Run, fmt: str, rows: int, context: int, chunk: int = 1) -> None:
        dev, gen = run.dev, run.gen
        self.fmt, self.rows, self.context, self.chunk = fmt, rows, context, chunk
        per_row = -(-context // PAGE)
        order = torch.randperm(rows * per_row, generator=gen, device=dev)
        self.page_table = order.reshape(rows, per_row).to(torch.int32)
        slots = rows * per_row * PAGE
        self.k = [planes(fmt, slots, gen, dev) for _ in range(LAYERS)]
        self.v = [planes(fmt, slots, gen, dev) for _ in range(LAYERS)]
        self.q = torch.randn(rows * chunk, HEADS, DIM, generator=gen, device=dev)
        self.query_start = torch.arange(rows + 1, dtype=torch.int32) * chunk
        self.seq_lens = torch.full((rows,), context, dtype=torch.int32)
        last = torch.arange(context - chunk, context, dtype=torch.int32, device=dev)
        self.positions = last.repeat(rows)

    def kwargs(self) -> dict:
        return dict(query_start=self.query_start, seq_lens=self.seq_lens,
                    positions=self.positions, page_table=self.page_table, page_size=PAGE,
                    scale=DIM ** -0.5)

    def call(self, layer: int, plan, cfg: AttnConfig) -> torch.Tensor:
        return paged_attention(self.q, self.k[layer], self.v[layer], self.fmt, self.fmt,
                               plan=plan, config=cfg, **self.kwargs())


def measure(run: Run, case: Case, cfg: AttnConfig, fill: int = 0,
            least: int | None = None) -> dict:
    plan = plan_attention(case.query_start, case.seq_lens, group=HEADS // KV_HEADS,
                          window=None, config=cfg, device=run.dev, fill=fill, least=least)
    got = case.call(0, plan, cfg).double()
    want = paged_attention_reference(case.q, case.k[0], case.v[0], case.fmt, case.fmt,
                                     **case.kwargs())
    err = float((got - want).abs().max())
    row = {"kv": case.fmt, "rows": case.rows, "context": case.context, "chunk": case.chunk,
           "fill": fill, "slots": plan.num_slots,
           "config": f"{cfg.block_m}x{cfg.block_n}x{cfg.split_keys}:{cfg.num_warps}"
                     + ("" if cfg.num_stages is None else f":{cfg.num_stages}"),
           "programs": int(plan.work.shape[0]) * KV_HEADS, "max_err": err,
           "ok": err < 2e-2}
    if row["ok"]:
        calls = [lambda i=i: case.call(i % LAYERS, plan, cfg) for i in range(LAUNCHES)]
        row["us"] = round(run.time_us(calls), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--contexts", default=None, help="default 96,1024,4096 (--smoke: 40)")
    ap.add_argument("--kv", default="f16,q8")
    ap.add_argument("--configs", default="64x64x256,16x64x256,16x128x256,16x128x128,"
                                         "16x128x512,16x256x256,32x128x256,16x128x256:2,"
                                         "16x128x256:8,16x64x128")
    ap.add_argument("--chunk", type=int, default=1, help="query tokens a row (its last)")
    ap.add_argument("--fill", default="0", help="plan_attention fill values, comma-separated")
    ap.add_argument("--least", type=int, default=None,
                    help="plan_attention's least keys a cut item (default MIN_PREFILL_SPLIT)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.rows, args.configs = "2", "16x32x32,64x64x256"
        args.contexts, args.chunk = args.contexts or "40", min(args.chunk, 20)
    args.contexts = args.contexts or "96,1024,4096"
    run = Run(args)
    configs = [parse_config(c) for c in args.configs.split(",")]
    fills = [int(f) for f in args.fill.split(",")]
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit_id(),
           "device": "cpu" if args.smoke else torch.cuda.get_device_name(0),
           "pdl": os.environ["MBUFO_PDL"], **run.out}
    for fmt in args.kv.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                if run.left() < 0:
                    out["skipped"].append(f"{fmt} {rows}x{context}: out of budget")
                    continue
                case = run.attempt(f"{fmt} {rows}x{context}", lambda f=fmt, r=rows, c=context:
                                   Case(run, f, r, c, args.chunk))
                variants = [(cfg, fill) for cfg in configs for fill in fills]
                for cfg, fill in variants if case is not None else ():
                    row = run.attempt(f"{fmt} {rows}x{context} {cfg} fill {fill}",
                                      lambda c=cfg, f=fill, k=case:
                                      measure(run, k, c, f, args.least))
                    if row is not None:
                        out["rows"].append(row)
                        print(f"{row['kv']:>4} rows {row['rows']:>3} ctx {row['context']:>5} "
                              f"chunk {row['chunk']:>4} fill {row['fill']:>3} "
                              f"{row['config']:>14} programs {row['programs']:>5} "
                              f"err {row['max_err']:.1e} us {row.get('us', 'FAILED')}",
                              flush=True)
                case = None  # its planes go before the next case's
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "attn_bench.json").write_text(json.dumps(out, indent=1))
    bad = [r for r in out["rows"] if not r["ok"]]
    return 1 if bad or out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
