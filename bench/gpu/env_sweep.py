"""engine_bench.py once per environment setting (a decode-path switch, a carveout, PDL off),
each in a process of its own, into one JSON: the switches read their environment once per
process or per step, so an A/B of them is a sweep of processes.

Run on the device machine:
    python bench/gpu/env_sweep.py --vocab VOCAB.gguf --out $OUT \\
        --run base:1 --run 'carve:1:MBUFO_CARVEOUT=15' --run 'nopdl:16:MBUFO_PDL=0' \\
        -- --variants q8+graphs --tokens 64 --no-profile --prefill 512
A run is NAME:CONCURRENCY[:VAR=VALUE,VAR=VALUE...] (an item without `=` continues the
value before it: `MBUFO_CARVEOUT_KERNELS=_a_kernel,_b_kernel`); a NAME ending in `+profile` adds
`--graph-profile CONCURRENCY` (the last step's time by kernel, `step_shares`). Arguments
after `--` go to every engine_bench.py run. `sweep.json` under --out is rewritten after
every run (a sweep cut short keeps what it measured): per run its environment, the
variants' decode_tps, steady_tok_s (the rate once every stream decodes, where there are
several) and prefill_tps, the profiled step's shares, the log's last lines
where the run failed, and engine_bench's whole JSON; the runs' logs go to `sweep.log`.
Two files in all (the device tool brings back only a few). One line per run is printed
as it ends.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from provenance import commit_id

ENGINE_BENCH = Path(__file__).resolve().parent / "engine_bench.py"
_NAME = re.compile(r"[A-Za-z0-9_.-]+(\+profile)?")
_VAR = re.compile(r"[A-Z_][A-Z0-9_]*")


def parse_run(text: str) -> tuple[str, int, dict[str, str]]:
    """NAME:CONCURRENCY[:VAR=VALUE,...] -> (name, concurrency, environment); ValueError
    with the text for anything else."""
    name, _, rest = text.partition(":")
    level, _, env_text = rest.partition(":")
    if not _NAME.fullmatch(name) or not level.isdigit() or int(level) < 1:
        raise ValueError(f"--run {text!r}: want NAME:CONCURRENCY[:VAR=VALUE,...] "
                         "(NAME of letters, digits, '.', '_', '-'; CONCURRENCY >= 1)")
    env: dict[str, str] = {}
    var = None
    for item in filter(None, env_text.split(",")):
        name_, eq, value = item.partition("=")
        if eq and _VAR.fullmatch(name_):
            var, env[name_] = name_, value
        elif var is not None and not eq:  # a list value: VAR=a,b
            env[var] += "," + item
        else:
            raise ValueError(f"--run {text!r}: {item!r} is not VAR=VALUE")
    return name, int(level), env


def summarize(name: str, env: dict[str, str], result: dict | None, log: str,
              seconds: float) -> dict:
    """One run's record from engine_bench's JSON (None: it wrote none)."""
    record: dict = {"run": name, "env": env, "seconds": round(seconds, 1)}
    if result is None:
        record["error"] = "no engine_bench.json"
        record["log_tail"] = log.splitlines()[-20:]
        return record
    for variant, figures in result.get("variants", {}).items():
        row = {k: figures[k] for k in ("decode_tps", "prefill_tps", "error") if k in figures}
        steady = {c: d["steady_tok_s"] for c, d in (figures.get("decode") or {}).items()
                  if isinstance(d, dict) and d.get("steady_tok_s") is not None}
        if steady:  # the rate once every stream decodes (engine_bench's run_batch)
            row["steady_tok_s"] = steady
        profile = next(iter(figures.get("graph_profile", {}).values()), None)
        if profile:
            row["step_shares"] = profile.get("step_shares")
            row["kernels_per_step"] = profile.get("kernels_per_step")
        record.setdefault("variants", {})[variant] = row
        if "error" in figures:
            record["log_tail"] = log.splitlines()[-20:]
    return record


def line(record: dict) -> str:
    """The run's figures on one line."""
    if "error" in record:
        return f"{record['run']}: FAILED ({record['error']})"
    cells = []
    for variant, row in record.get("variants", {}).items():
        decode = ", ".join(f"{c}: {v:.1f}" for c, v in (row.get("decode_tps") or {}).items()
                           if v is not None)
        prefill = ", ".join(f"{n}: {v:.0f}" for n, v in (row.get("prefill_tps") or {}).items()
                            if v is not None)
        steady = ", ".join(f"{c}: {v:.1f}" for c, v in (row.get("steady_tok_s") or {}).items())
        cells.append(f"{variant} decode {{{decode}}}"
                     + (f" steady {{{steady}}}" if steady else "") + f" prefill {{{prefill}}}"
                     + (f" FAILED {row['error']}" if "error" in row else ""))
    env = ",".join(f"{k}={v}" for k, v in record["env"].items()) or "-"
    return f"{record['run']} [{env}] {'; '.join(cells)} ({record['seconds']} s)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--run", action="append", required=True,
                    help="NAME:CONCURRENCY[:VAR=VALUE,...]; repeat for more runs")
    ap.add_argument("--bench", default=str(ENGINE_BENCH), help=argparse.SUPPRESS)
    args = ap.parse_args(ours)
    try:
        runs = [parse_run(text) for text in args.run]
    except ValueError as exc:
        ap.error(str(exc))
    if len({name for name, _, _ in runs}) != len(runs):
        ap.error("--run names must differ")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sweep = {"commit": commit_id(), "date": time.strftime("%Y-%m-%d"),
             "engine_bench_args": bench_args, "runs": []}
    for name, level, env in runs:
        run_dir = out / name.replace("+", "_")
        cmd = [sys.executable, args.bench, "--vocab", args.vocab, "--concurrency", str(level),
               "--out", str(run_dir), *bench_args]
        if name.endswith("+profile"):
            cmd += ["--graph-profile", str(level)]
        started = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
        log = proc.stdout + proc.stderr
        with (out / "sweep.log").open("a") as logs:
            logs.write(f"=== {name} {env} (exit {proc.returncode})\n{log}\n")
        found = run_dir / "engine_bench.json"
        result = json.loads(found.read_text()) if found.exists() else None
        shutil.rmtree(run_dir, ignore_errors=True)
        record = summarize(name, env, result, log, time.perf_counter() - started)
        record["concurrency"] = level
        record["engine_bench"] = result
        sweep["runs"].append(record)
        (out / "sweep.json").write_text(json.dumps(sweep, indent=1))
        print(line(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
