"""The one-row gated MLP as one flow launch (kernels/qint_flow.py) against its three launches.

Times `layers` MLPs of Llama-3.1-8B's shapes (hidden 4096, FFN 14336; gate|up Q4_K, down
Q4_K or Q6_K as Q4_K_M mixes them), x fixed (one row, quantized once), each layer's weights
its own (they miss the L2), in one CUDA graph each way:

- `launches`: the engine's way: qint's gate|up launch, the activation (gated_act_quant),
  qint's down launch, as programmatic dependent launches;
- `flow`: one mlp_flow launch a layer, at each config and program count asked.

Each flow launch's gate|up outputs and quantized activation are checked bit-equal to the
launches', its y within 2^-14 of the largest |y| (the down sums are taken in another
order), and its error count (polls given up) zero.

    python3 bench/gpu/flow_bench.py [--layers 32] [--configs default,...] [--programs 1.0,0.5]
    python3 bench/gpu/flow_bench.py --smoke    # interpreted, tiny shapes, one program

Writes $OUT/flow_bench.json; prints us a layer and GB/s against the copy ceiling.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before Triton is imported: the interpreter's own functions
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
from datetime import UTC, datetime  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench" / "gpu")]

import torch  # noqa: E402
from kernels_check import random_blocks  # noqa: E402
from provenance import commit_id  # noqa: E402
from qmatmul_bench import Run, ceilings  # noqa: E402

from kernels.gated_act import gated_act_quant  # noqa: E402
from kernels.qint import (  # noqa: E402
    Q4_K,
    Q6_K_A,
    QK,
    QIntConfig,
    default_qint_config,
    in_cta_config,
    qint_triton,
    quantize_x,
)
from kernels.qint_flow import (  # noqa: E402
    DX_PAD,
    FlowConfig,
    counter_ints,
    mlp_flow,
    resident_programs,
)

# name -> FlowConfig fields changed from the default
CONFIGS = {
    "default": {},
    "lag7": {"lag": 7},  # every gate|up item ahead of every down item
    "c4": {"chunk_sb": 4},  # 14 chunks of 1024 columns
    "d8x8": {"d_rows": 8, "d_split": 8},  # a down item 8 rows, one super-block a split
    "d32x4": {"d_rows": 32, "d_split": 4},
    "g8": {"gu_rows": 8, "gu_split": 8},  # small gate|up items: 2 super-blocks a split
    "g8l1": {"gu_rows": 8, "gu_split": 8, "lag": 1},
    "g8l3": {"gu_rows": 8, "gu_split": 8, "lag": 3},
    "g16": {"gu_rows": 16, "gu_split": 4},
    "r144": {"max_regs": 144},
    "w4": {"num_warps": 4, "max_regs": None},
    "nowait": {"probe": 1},  # timing only: down items never wait
    "guonly": {"probe": 2},  # timing only: the gate|up items alone
    "g8guonly": {"gu_rows": 8, "gu_split": 8, "probe": 2},
}


def parse_config(name: str) -> FlowConfig:
    """A CONFIGS name, or fields as key=value joined by '+' (chunk_sb=4+d_rows=8)."""
    if name in CONFIGS:
        return FlowConfig()._replace(**CONFIGS[name])
    fields = {}
    for item in name.split("+"):
        key, value = item.split("=")
        fields[key] = None if value == "none" else int(value)
    return FlowConfig()._replace(**fields)


def _flowed(xq, gu_w, d_w, down_type, hidden, ffn, programs, cfg, ctr) -> None:
    """Every layer's flow launch."""
    for i in range(len(gu_w)):
        mlp_flow(xq, gu_w[i], d_w[i], down_type, hidden, ffn, "silu", programs, cfg, ctr)


def bench(run: Run, down_name: str, hidden: int, ffn: int, layers: int, configs: list[str],
          fractions: list[float]) -> dict:
    down_type = Q4_K if down_name == "Q4_K" else Q6_K_A
    gu_w = torch.stack([random_blocks(run, "Q4_K", 2 * ffn, hidden) for _ in range(layers)])
    if down_type == Q4_K:
        d_w = torch.stack([random_blocks(run, "Q4_K", hidden, ffn) for _ in range(layers)])
    else:
        from kernels.qint import repack_q6k

        d_w = torch.stack([repack_q6k(random_blocks(run, "Q6_K", hidden, ffn), ffn)
                           for _ in range(layers)])
    x = torch.randn(1, hidden, device=run.dev, generator=run.gen)
    xq = quantize_x(x)
    mb = (gu_w[0].numel() + d_w[0].numel()) / 1e6
    row = {"down": down_name, "hidden": hidden, "ffn": ffn, "layers": layers,
           "mb_per_layer": mb, "mb_gate_up": gu_w[0].numel() / 1e6, "mb_down": d_w[0].numel() / 1e6}
    sms = run.sms
    # the engine's one-row gate|up launch (the interpreter has no compute units to split
    # for: the default flow tile's split given)
    gu_cfg = default_qint_config(Q4_K, 2 * ffn, hidden, sms, m=1) if sms else \
        in_cta_config(QIntConfig(64, 2, 2))

    def launches(i: int) -> tuple[torch.Tensor, torch.Tensor, object]:
        gu = qint_triton(x, gu_w[i], Q4_K, (2 * ffn, hidden), gu_cfg, xq=xq)
        act, aq = gated_act_quant(gu, "silu")
        return qint_triton(act, d_w[i], down_type, (hidden, ffn), xq=aq), gu, aq

    want = [launches(i) for i in range(min(layers, 2))]

    def chained() -> None:
        for i in range(layers):
            launches(i)

    def gu_alone() -> None:
        for i in range(layers):
            qint_triton(x, gu_w[i], Q4_K, (2 * ffn, hidden), gu_cfg, xq=xq)

    aq0 = want[0][2]

    def down_alone() -> None:
        for i in range(layers):
            qint_triton(want[0][1][:, :ffn], d_w[i], down_type, (hidden, ffn), xq=aq0)

    if not run.smoke:
        row["launches"] = run.time_us([chained]) / layers
        row["gate_up_launch"] = run.time_us([gu_alone]) / layers
        row["down_launch"] = run.time_us([down_alone]) / layers
    for name in configs:
        cfg = parse_config(name)
        ctr = torch.zeros(counter_ints(ffn, hidden, cfg), dtype=torch.int32, device=run.dev)
        most = 1 if run.smoke else resident_programs(xq, gu_w[0], d_w[0], down_type, hidden,
                                                     ffn, "silu", cfg)
        row[f"{name}_resident"] = most
        for frac in fractions:
            programs = min(most, int(frac)) if frac > 1 else max(1, int(most * frac))
            label = f"{name}@{programs}"
            if cfg.probe:  # timing only: its outputs are wrong, its counts left over
                if not run.smoke:
                    row[label] = run.time_us([partial(_flowed, xq, gu_w, d_w, down_type,
                                                      hidden, ffn, programs, cfg, ctr)]) / layers
                ctr.zero_()
                continue
            y, gu, aq = mlp_flow(xq, gu_w[0], d_w[0], down_type, hidden, ffn, "silu",
                                 programs, cfg, ctr)
            chunks = ffn // (QK * cfg.chunk_sb)
            dx = aq.dx.reshape(chunks, DX_PAD)[:, :cfg.chunk_sb].reshape(1, -1)
            y_want, gu_want, aq_want = want[0]
            same_tile = (cfg.gu_rows, cfg.gu_split) == (gu_cfg.block_n, gu_cfg.split)
            # another gate|up tile sums in another order: within 2^-14, then, and the
            # activation and y from its own gate|up (the launches' only with the same tile)
            if not same_tile:
                act, aq_want = gated_act_quant(gu, "silu")
                y_want = qint_triton(act, d_w[0], down_type, (hidden, ffn), xq=aq_want)
            ok = {"gu": bool(torch.equal(gu, gu_want)) if same_tile else
                  float((gu - gu_want).abs().max() / gu_want.abs().max()) <= 2**-14,
                  "act": bool(torch.equal(aq.q, aq_want.q) and torch.equal(dx, aq_want.dx)
                              and torch.equal(aq.bs, aq_want.bs)),
                  "y": float((y - y_want).abs().max() / y_want.abs().max()),
                  "errors": int(ctr[0]), "counters_zero": bool(ctr[1:].eq(0).all())}
            ok["ok"] = ok["gu"] and ok["act"] and ok["y"] <= 2**-14 and not ok["errors"] \
                and ok["counters_zero"]
            row[f"{label}_check"] = ok
            if not ok["ok"]:
                print(f"CHECK FAILED {down_name} {label}: {ok}", flush=True)
                continue
            if not run.smoke:
                row[label] = run.time_us([partial(_flowed, xq, gu_w, d_w, down_type, hidden,
                                                  ffn, programs, cfg, ctr)]) / layers
                row[f"{label}_errors_after"] = int(ctr[0])
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--downs", default="Q4_K,Q6_K")
    ap.add_argument("--configs", default="default")
    ap.add_argument("--programs", default="1.0",
                    help="fractions of the resident programs to launch (above 1: counts)")
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    hidden, ffn = (512, 2048) if args.smoke else (4096, 14336)
    if args.smoke:
        args.layers = 2
    run = Run(args)
    out = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": commit_id(),
           "device": "cpu" if args.smoke else torch.cuda.get_device_name(0), **run.out}
    if not args.smoke:
        out["ceilings"] = ceilings(run)
        print(f"copy {out['ceilings']['copy_gb_s']:.0f} GB/s; us a layer (GB/s):", flush=True)
    configs = args.configs.split(",")
    if args.smoke:
        configs = ["chunk_sb=4+d_split=2"]
    fractions = [float(f) for f in args.programs.split(",")]
    for down in args.downs.split(","):
        if run.left() < 30:
            out["skipped"].append(down)
            continue
        row = run.attempt(down, lambda d=down: bench(run, d, hidden, ffn, args.layers, configs,
                                                      fractions))
        if row is None:
            continue
        out["rows"].append(row)
        for key, value in row.items():
            if isinstance(value, float) and not key.startswith("mb_"):
                mb = {"gate_up_launch": row["mb_gate_up"], "down_launch": row["mb_down"]}.get(
                    key, row["mb_per_layer"])
                print(f"{down} {key:28} {value:7.2f} us ({mb / value * 1e3:5.0f} GB/s)",
                      flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "flow_bench.json").write_text(json.dumps(out, indent=1))
    bad = [f"{r['down']} {k}" for r in out["rows"] for k, v in r.items()
           if k.endswith("_check") and not v["ok"]]
    print(f"failures: {bad}; errors: {len(out['errors'])}")
    return 1 if bad or out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
