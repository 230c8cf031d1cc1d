"""llama.cpp's figures as the peer of bench/RESULTS.md's JSON: `llama-bench -o json` (tg and
pp rates) and `llama-batched-bench`'s table (S_TG: the decode rate over all sequences, by
their count), both run on the engine's synthetic file (bench/gpu/llama_cpp_peer.sh).

    python bench/gpu/llama_cpp_peer.py --bench-json B.json --batched-txt T.txt --out peer.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse(bench: list[dict], batched: str) -> dict:
    """-> {"decode_tps": {sequences: tok/s}, "prefill_tps": {tokens: tok/s}, "tg": {...}}:
    llama-bench's generation rows under "tg" (by tokens generated), its prompt rows as
    prefill_tps; the batched table's S_TG by its B column as decode_tps."""
    out: dict = {"decode_tps": {}, "prefill_tps": {}, "tg": {}}
    for row in bench:
        if row["n_gen"] and not row["n_prompt"]:
            out["tg"][str(row["n_gen"])] = round(float(row["avg_ts"]), 1)
        elif row["n_prompt"] and not row["n_gen"]:
            out["prefill_tps"][str(row["n_prompt"])] = round(float(row["avg_ts"]), 1)
    header: list[str] | None = None
    for line in batched.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            if not {"B", "S_TG t/s"} <= set(header):
                raise ValueError("llama-batched-bench's table has no B and S_TG t/s "
                                 f"columns: {header}")
        elif cells[0] and not set(cells[0]) <= {"-"}:
            row = dict(zip(header, cells, strict=True))
            out["decode_tps"][row["B"]] = float(row["S_TG t/s"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-json", required=True, help="llama-bench -o json's output")
    ap.add_argument("--batched-txt", required=True, help="llama-batched-bench's output")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    peer = parse(json.loads(Path(args.bench_json).read_text()),
                 Path(args.batched_txt).read_text())
    Path(args.out).write_text(json.dumps(peer, indent=1))
    print(json.dumps(peer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
