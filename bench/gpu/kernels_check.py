"""Correctness and speed of the Triton kernels at Llama-3.1-8B shapes on a GPU.

    python bench/gpu/kernels_check.py                 # on the device machine, < 8 minutes
    TRITON_INTERPRET=1 python bench/gpu/kernels_check.py --smoke   # this script's logic, CPU

qmatmul on random GGUF blocks of every type, shapes qkv 4096->6144, o 4096->4096, gate+up
4096->28672, down 14336->4096, head 4096->128256, M in 1, 16, 64, 512: every element within
2^-7 (|W| @ |x|) of the float64 product of kernels.dequant.dequantize_reference (bit-equal
to gguf-py, checked in CI), row 0 bit-equal across M; timed (do_bench median) for several
configs against the measured ceilings (device copy, bf16 torch.matmul) and torch's bf16
matmul on the dequantized weights. paged_attention on decode, mixed, long and prefill
batches in each KV format against its float64 reference (a decode row bit-equal alone and
in the mixed batch), then timed. Writes $OUT/kernels.json (or --out); the table is last."""

from __future__ import annotations

import argparse
import enum
import itertools
import json
import os
import sys
import time
import types
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

# GGML type ids (ggml.h). kernels.dequant names types through gguf-py, which the device
# machine lacks: a stand-in enum with these values takes its place (tests/kernels checks
# them against gguf-py's).
GGML_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
              "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20,
              "IQ4_XS": 23, "BF16": 30, "MXFP4": 39}
try:
    import gguf  # noqa: F401
except ImportError:
    sys.modules["gguf"] = types.SimpleNamespace(
        GGMLQuantizationType=enum.IntEnum("GGMLQuantizationType", GGML_TYPES))

from kernels import paged_attention as attn  # noqa: E402
from kernels.dequant import dequantize_reference  # noqa: E402
from kernels.qmatmul import QMMConfig, default_config, qmatmul_triton  # noqa: E402
from kernels.qtiles import GEOMETRY  # noqa: E402

F16_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
              "Q6_K": (208,), "IQ4_XS": (0,), "MXFP4": ()}
ALL_TYPES = ["Q8_0", "Q4_K", "Q6_K", "Q4_0", "Q5_0", "Q5_K", "IQ4_XS", "MXFP4", "BF16"]
LLAMA = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
         ("down", 4096, 14336), ("head", 128256, 4096)]


class Run:
    """Device, deadline and timer shared by every phase; results collect in `out`."""

    def __init__(self, smoke: bool, budget_s: float) -> None:
        self.smoke = smoke
        self.dev = torch.device("cpu" if smoke else "cuda")
        self.deadline = time.perf_counter() + budget_s
        seed = int(time.time())
        self.gen = torch.Generator(self.dev).manual_seed(seed)
        self.out: dict = {"seed": seed, "skipped": []}

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def time_ms(self, fn) -> float:
        """Median milliseconds of fn() (one call under the interpreter)."""
        if self.smoke:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")

    def attempt(self, what: str, fn):
        """fn(), or None with the failure (say, too much shared memory) in out["errors"]."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one bad config must not end the run
            self.out.setdefault("errors", []).append(f"{what}: {type(exc).__name__}: "
                                                     f"{str(exc)[:300]}")
            print("ERROR", self.out["errors"][-1])
            return None


def ceilings(run: Run) -> dict:
    n = 1 << (20 if run.smoke else 30)
    src = torch.empty(n, dtype=torch.uint8, device=run.dev).random_(generator=run.gen)
    dst = torch.empty_like(src)
    copy_ms = run.time_ms(lambda: dst.copy_(src))
    size = 256 if run.smoke else 8192
    a = torch.randn(size, size, device=run.dev, generator=run.gen).bfloat16()
    mm_ms = run.time_ms(lambda: a @ a)
    return {"copy_gb_s": 2 * n / copy_ms / 1e6, "bf16_tflop_s": 2 * size**3 / mm_ms / 1e9}


def random_blocks(run: Run, name: str, n: int, k: int) -> torch.Tensor:
    """(n, k / block * bytes) uint8: random bytes, finite random f16 scales (BF16: normal
    values)."""
    if name == "BF16":
        w = torch.randn(n, k, device=run.dev, generator=run.gen).bfloat16()
        return w.view(torch.uint8)
    block, size, _ = GEOMETRY[GGML_TYPES[name]]
    raw = torch.randint(0, 256, (n, k // block, size), dtype=torch.uint8, device=run.dev,
                        generator=run.gen)
    for off in F16_FIELDS[name]:
        half = torch.randn(n, k // block, 1, device=run.dev, generator=run.gen).half()
        raw[:, :, off:off + 2] = half.view(torch.uint8)
    if name == "MXFP4":
        raw[:, :, 0] = torch.randint(110, 140, (n, k // block), dtype=torch.uint8,
                                     device=run.dev, generator=run.gen)
    return raw.view(n, -1)


def config_name(c: QMMConfig) -> str:
    return (f"bm{c.block_m} bn{c.block_n} bk{c.block_k} s{c.split_k} w{c.num_warps}"
            + ("" if c.num_stages is None else f" st{c.num_stages}"))


def default_cfg(run: Run, qtype: int, m: int, n: int, k: int) -> QMMConfig:
    sms = 0 if run.smoke else torch.cuda.get_device_properties(run.dev).multi_processor_count
    backend = "hip" if torch.version.hip and not run.smoke else "cuda"
    return default_config(qtype, m, n, k, backend=backend, num_sms=sms)


def check_qmatmul(run: Run, shapes, ms) -> None:
    """Every type, shape and M against float64; bit-equal rows across M."""
    rows = run.out.setdefault("qmatmul_check", [])
    for name in ALL_TYPES:
        qtype = GGML_TYPES[name]
        for label, n, k in shapes:
            if run.left() < 60:
                run.out["skipped"].append(f"check {name} {label}")
                continue
            blocks = random_blocks(run, name, n, k)
            w = dequantize_reference(blocks.view(-1), qtype, (n, k), torch.float32).double()
            x = torch.randn(max(ms), k, device=run.dev, generator=run.gen).bfloat16()
            first = None
            for m in ms:
                row = {"type": name, "shape": label, "m": m, "ok": False}
                rows.append(row)
                y = run.attempt(f"check {name} {label} M={m}", partial(
                    qmatmul_triton, x[:m], blocks, qtype, (n, k), default_cfg(run, qtype, m, n, k)))
                if y is None:
                    continue
                ref, bound = x[:m].double() @ w.T, x[:m].double().abs() @ w.abs().T
                err = float(((y.double() - ref).abs() / bound).max())
                first = y[0] if first is None else first
                row.update(max_err_over_bound=err, ok=bool(torch.isfinite(y).all()) and
                           err <= 2**-7, row0_bitequal_to_m1=bool(torch.equal(first, y[0])))
                print(f"check qmatmul {json.dumps(row)}")
            del w


def qmm_variants(run: Run, qtype: int, m: int, n: int, k: int) -> list[QMMConfig]:
    """The default config first, then tile sizes, split-K and warps around it."""
    base, step = default_cfg(run, qtype, m, n, k), GEOMETRY[qtype][2]
    if run.smoke:
        out = [base, base._replace(block_n=16)]
    elif m <= 16:
        out = [base] + [base._replace(block_n=bn, split_k=s) for bn in (16, 32, 64)
                        for s in (1, 2, 4, 8)] + [base._replace(block_k=min(2 * base.block_k, 256))]
    else:
        out = [base, base._replace(split_k=1)] + [
            base._replace(block_m=bm, block_n=bn, num_warps=w, split_k=1)
            for bm, bn, w in ((64, 64, 4), (64, 128, 8), (128, 64, 8))]
    ok = [c for c in out if k % (c.split_k * c.block_k) == 0 and c.block_k % step == 0
          and (step < 128 or c.block_k == step)]
    return list(dict.fromkeys(ok))


def bench_qmatmul(run: Run, shapes, ms, types_, sweep: bool) -> None:
    rows = run.out.setdefault("qmatmul_bench", [])
    ceil = run.out["ceilings"]
    for name in types_:
        qtype = GGML_TYPES[name]
        for label, n, k in shapes:
            if run.left() < 30:
                run.out["skipped"].append(f"bench {name} {label}")
                continue
            blocks = random_blocks(run, name, n, k)
            w16 = (dequantize_reference(blocks.view(-1), qtype, (n, k), torch.bfloat16)
                   if not sweep else None)
            for m in ms:
                x = torch.randn(m, k, device=run.dev, generator=run.gen).bfloat16()
                configs = qmm_variants(run, qtype, m, n, k) if sweep else \
                    [default_cfg(run, qtype, m, n, k)]
                for cfg in configs:
                    if run.left() < 20:
                        run.out["skipped"].append(f"bench {name} {label} {m}")
                        break
                    ms_ = run.attempt(f"bench {name} {label} M={m} {config_name(cfg)}",
                                      partial(run.time_ms, partial(
                                          qmatmul_triton, x, blocks, qtype, (n, k), cfg)))
                    if ms_ is None:
                        continue
                    rows.append(_perf(name, label, m, n, k, config_name(cfg), ms_,
                                      blocks.numel(), ceil, default=cfg == configs[0]))
                    print("bench qmatmul", json.dumps(rows[-1]))
                if w16 is not None:
                    ms_ = run.time_ms(partial(torch.matmul, x, w16.t()))
                    rows.append(_perf(name, label, m, n, k, "torch bf16", ms_, w16.numel() * 2,
                                      ceil, default=False))
                    print("bench torch  ", json.dumps(rows[-1]))


def _perf(name, label, m, n, k, config, ms_, weight_bytes, ceil, default) -> dict:
    gbs, tfs = weight_bytes / ms_ / 1e6, 2 * m * n * k / ms_ / 1e9
    return {"type": name, "shape": label, "m": m, "config": config, "default": default,
            "us": ms_ * 1e3, "weight_gb_s": gbs, "tflop_s": tfs, "pct_copy_bw": 100 * gbs /
            ceil["copy_gb_s"], "pct_bf16_peak": 100 * tfs / ceil["bf16_tflop_s"]}


def attention_case(run: Run, rows, heads: int, kv_heads: int, dim: int, kv_quant: str) -> dict:
    """Random KV encoded by the engine's formats into randomly permuted pages of 16."""
    from engine.kv.formats import FORMATS, KV_QUANT_CHOICES

    page = 16
    k_name, v_name = KV_QUANT_CHOICES[kv_quant]
    counts = [-(-length // page) for _, length in rows]
    perm = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(len(rows)))
    table = torch.full((len(rows), max(counts)), -1, dtype=torch.int32)
    for r, (start, count) in enumerate(zip(itertools.accumulate([0, *counts]), counts,
                                           strict=False)):
        table[r, :count] = perm[start:start + count].int()
    slots = sum(counts) * page
    planes = []
    for fmt in (FORMATS[k_name], FORMATS[v_name]):
        x = torch.randn(slots, kv_heads, dim, device=run.dev, generator=run.gen)
        x[..., 5] *= 20  # an outlier channel
        planes.append({n: p.contiguous() for n, p in fmt.encode(x).items()})
    starts = [0] + torch.tensor([new for new, _ in rows]).cumsum(0).tolist()
    positions = [p for new, length in rows for p in range(length - new, length)]
    meta = dict(query_start=torch.tensor(starts), seq_lens=torch.tensor([n for _, n in rows]),
                positions=torch.tensor(positions, dtype=torch.int32, device=run.dev),
                page_table=table.to(run.dev), page_size=page, scale=dim**-0.5)
    q = torch.randn(starts[-1], heads, dim, device=run.dev, generator=run.gen)
    bytes_per_key = kv_heads * dim // 32 * (FORMATS[k_name].bytes_per_block
                                            + FORMATS[v_name].bytes_per_block)
    pairs = sum(sum(length - new + i + 1 for i in range(new)) for new, length in rows)
    return {"q": q, "k": planes[0], "v": planes[1], "formats": (k_name, v_name), "kvh": kv_heads,
            "meta": meta, "bytes_per_key": bytes_per_key, "pairs": pairs}


def attention_cases(run: Run) -> dict:
    g = torch.Generator().manual_seed(1)
    lens = lambda count, lo, hi: torch.randint(lo, hi, (count,), generator=g).tolist()  # noqa: E731
    if run.smoke:
        return {"decode": [(1, n) for n in (40, 70, 17)],
                "mixed": [(19, 19), (1, 40), (3, 35), (9, 30)]}
    return {"decode64": [(1, n) for n in lens(64, 1024, 8192)],
            "mixed": [(512, 4096)] + [(1, n) for n in lens(32, 2048, 8192)]
            + [(4, n) for n in lens(4, 2048, 4096)],
            "long1": [(1, 32768)], "prefill2k": [(2048, 2048)]}


def _attend(case: dict, config=None, plan=None):
    return attn.paged_attention(case["q"], case["k"], case["v"], *case["formats"], plan=plan,
                           config=config, **case["meta"])


ATTN_SWEEP = ((32, 32, 1024, 4), (64, 32, 1024, 4), (128, 64, 1024, 8), (64, 64, 512, 4),
              (64, 64, 2048, 4), (16, 64, 1024, 4))  # block_m, block_n, split_keys, warps


def check_and_bench_attention(run: Run, sweep: bool) -> None:
    """Every case and format: checked and timed at the default config (sweep=False), or
    timed over ATTN_SWEEP for two formats (sweep=True)."""
    heads, kv_heads, dim = (8, 2, 64) if run.smoke else (32, 8, 128)
    formats = ["f16", "k8v4"] if run.smoke else ["f16", "q8", "k8v4", "k4v4"]
    base = attn.AttnConfig.default(heads // kv_heads, dim, dim)
    configs = [base]
    if sweep:
        formats = formats[:1 if run.smoke else 2]
        configs = [base._replace(block_m=bm, block_n=bn, split_keys=s, num_warps=w)
                   for bm, bn, s, w in ATTN_SWEEP[:2 if run.smoke else None]]
    cases = attention_cases(run)
    for case_name, rows in list(cases.items())[:1 if sweep and run.smoke else None]:
        for kv_quant in formats:
            if run.left() < 40:
                run.out["skipped"].append(f"attention {case_name} {kv_quant}")
                continue
            case = attention_case(run, rows, heads, kv_heads, dim, kv_quant)
            if not sweep and not _check_attention(run, case, case_name, kv_quant):
                continue
            for cfg in configs:
                _bench_attention(run, case, case_name, kv_quant, cfg, heads, sweep)


def _check_attention(run: Run, case: dict, case_name: str, kv_quant: str) -> bool:
    checks = run.out.setdefault("attention_check", [])
    out = run.attempt(f"check attention {case_name} {kv_quant}", partial(_attend, case))
    if out is None:
        checks.append({"case": case_name, "kv": kv_quant, "ok": False})
        return False
    ref = attn.paged_attention_reference(case["q"], case["k"], case["v"], *case["formats"],
                                         **case["meta"])
    err = float((out.double() - ref).abs().max() / ref.abs().max())
    ok = bool(torch.isfinite(out).all()) and err < 4e-3
    checks.append({"case": case_name, "kv": kv_quant, "rel_err": err, "ok": ok})
    if case_name == "mixed":
        checks[-1]["decode_row_bitequal_alone"] = _alone_equal(case, out)
    print("check attention", json.dumps(checks[-1]))
    return True


def _bench_attention(run: Run, case: dict, case_name: str, kv_quant: str, cfg: attn.AttnConfig,
                     heads: int, named: bool) -> None:
    if run.left() < 20:
        run.out["skipped"].append(f"attention {case_name} {kv_quant} {cfg}")
        return
    meta = case["meta"]
    plan = attn.plan_attention(meta["query_start"], meta["seq_lens"], group=heads // case["kvh"],
                          window=None, config=cfg, device=run.dev)
    ms_ = run.attempt(f"bench attention {case_name} {kv_quant} {cfg}",
                      partial(run.time_ms, partial(_attend, case, cfg, plan)))
    if ms_ is None:
        return
    keys = (plan.work[:, 4] - plan.work[:, 3]).clamp(min=0).sum().item()
    name = (f"bm{cfg.block_m} bn{cfg.block_n} split{cfg.split_keys} w{cfg.num_warps}"
            if named else "default")
    run.out.setdefault("attention_bench", []).append({
        "case": case_name, "kv": kv_quant, "config": name, "us": ms_ * 1e3,
        "kv_gb_s": keys * case["bytes_per_key"] / ms_ / 1e6,
        "tflop_s": 2 * case["pairs"] * heads * 2 * case["q"].shape[2] / ms_ / 1e9})
    print("bench attention", json.dumps(run.out["attention_bench"][-1]))


def _alone_equal(case: dict, mixed_out: torch.Tensor) -> bool:
    """Row 1 of the mixed case (a decode row) run alone: bit-equal to its mixed output."""
    meta = case["meta"]
    t = int(meta["query_start"][1])
    alone = {**meta, "query_start": torch.tensor([0, 1]), "seq_lens": meta["seq_lens"][1:2],
             "positions": meta["positions"][t:t + 1], "page_table": meta["page_table"][1:2]}
    out = attn.paged_attention(case["q"][t:t + 1], case["k"], case["v"], *case["formats"], **alone)
    return bool(torch.equal(out[0], mixed_out[t]))


def table(out: dict) -> str:
    lines = [f"device {out['device']}: copy {out['ceilings']['copy_gb_s']:.0f} GB/s, "
             f"bf16 matmul {out['ceilings']['bf16_tflop_s']:.0f} TFLOP/s",
             f"{'type':6} {'shape':8} {'M':>4} | {'default us':>10} {'GB/s':>6} {'%bw':>4} "
             f"{'TF/s':>6} | {'best us':>8} {'best config':26} | {'torch us':>8}"]
    bench = out.get("qmatmul_bench", [])
    keys = sorted({(r["type"], r["shape"], r["m"]) for r in bench if r["config"] != "torch bf16"},
                  key=lambda t: (ALL_TYPES.index(t[0]), t[1], t[2]))
    for key in keys:
        rs = [r for r in bench if (r["type"], r["shape"], r["m"]) == key]
        mine = [r for r in rs if r["config"] != "torch bf16"]
        d = next((r for r in mine if r["default"]), mine[0])
        best = min(mine, key=lambda r: r["us"])
        torch_us = next((f"{r['us']:8.1f}" for r in rs if r["config"] == "torch bf16"), "")
        lines.append(f"{key[0]:6} {key[1]:8} {key[2]:4} | {d['us']:10.1f} {d['weight_gb_s']:6.0f} "
                     f"{d['pct_copy_bw']:4.0f} {d['tflop_s']:6.1f} | {best['us']:8.1f} "
                     f"{best['config']:26} | {torch_us:>8}")
    lines.append(f"{'attention':10} {'kv':5} {'config':26} {'us':>9} {'KV GB/s':>8} {'TF/s':>6}")
    for r in out.get("attention_bench", []):
        lines.append(f"{r['case']:10} {r['kv']:5} {r['config']:26} {r['us']:9.1f} "
                     f"{r['kv_gb_s']:8.0f} {r['tflop_s']:6.1f}")
    checks = out.get("qmatmul_check", []) + out.get("attention_check", [])
    same = [c["row0_bitequal_to_m1"] for c in checks if "row0_bitequal_to_m1" in c]
    alone = [c["decode_row_bitequal_alone"] for c in checks if "decode_row_bitequal_alone" in c]
    lines.append(f"correctness failures: {sum(not c['ok'] for c in checks)}; qmatmul rows "
                 f"bit-equal across M: {sum(same)}/{len(same)}; attention decode row "
                 f"bit-equal alone: {sum(alone)}/{len(alone)}; skipped: {len(out['skipped'])}; "
                 f"errors: {len(out.get('errors', []))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="phases past this many seconds are skipped (and listed)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    run = Run(args.smoke, args.budget_s)
    run.out["device"] = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    run.out["versions"] = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    shapes, ms = ([("a", 32, 256)], [1, 3, 17]) if args.smoke else (LLAMA, [1, 16, 64, 512])
    run.out["ceilings"] = ceilings(run)
    print("ceilings", run.out["ceilings"])
    check_qmatmul(run, shapes, ms)
    bench_qmatmul(run, shapes, ms, ["Q8_0"] if args.smoke else ALL_TYPES, sweep=False)
    check_and_bench_attention(run, sweep=False)
    bench_qmatmul(run, shapes, ms, ALL_TYPES[1:2] if args.smoke else ALL_TYPES[:3], sweep=True)
    check_and_bench_attention(run, sweep=True)
    run.out["elapsed_s"] = time.perf_counter() - start
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "kernels.json").write_text(json.dumps(run.out, indent=1))
    print(table(run.out))
    failures = [c for c in run.out["qmatmul_check"] + run.out["attention_check"] if not c["ok"]]
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
