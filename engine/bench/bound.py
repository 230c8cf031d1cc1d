"""The bandwidth bound of one decoding stream, and a figure's share of it.

One stream's decode reads, every token, the bytes of engine/planner.py's
`decode_read_bytes` (the linears as the file holds them, the norms, one token-table row and
the KV of its context). A device that moves `rate` bytes a second cannot decode faster
than rate / bytes tokens a second. The rate is measured, not taken from a data sheet: an
SM copy (read + write, `torch.mul(src, 1.0, out=dst)`, not a copy-engine memcpy) over
`nbytes` of memory, bytes read and written counted; on a GPU ten copies back to back are
timed together (the rate memory sustains), the best of several such batches.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.gguf import ModelFile
from engine.models.config import ModelConfig
from engine.planner import decode_read_bytes

__all__ = ["CPU_COPY_BYTES", "DEFAULT_COPY_BYTES", "GPU_BATCH", "bound_line", "copy_rate_gb_s",
           "decode_bound", "loaded_bound", "share_of_bound"]

DEFAULT_COPY_BYTES = 1 << 30  # 1 GiB: far past any cache (the H200's L2 holds 50 MB)
CPU_COPY_BYTES = 256 << 20  # the CPU's caches are smaller; its copy is slower
GPU_BATCH = 10  # copies timed together on a GPU: the rate sustained, not one kernel's ramp


def copy_rate_gb_s(device: torch.device | str, nbytes: int | None = None,
                   repeats: int = 10) -> float:
    """GB/s (1e9) read plus written by an SM copy of `nbytes` (float32) on `device`, the
    rate memory sustains: on a GPU the fastest of `repeats` timed batches of GPU_BATCH
    copies back to back after one untimed (one copy between two events also counts its
    kernel's ramp and tail: on the H200 4062 GB/s against 4241-4256 for the batches, and
    the kernel benches' ceilings time such batches; bench/RESULTS.md, 2026-12-03); on the
    CPU the fastest of `repeats` single copies. `nbytes` None: DEFAULT_COPY_BYTES on a
    GPU, CPU_COPY_BYTES on the CPU."""
    device = torch.device(device)
    gpu = device.type == "cuda"
    if nbytes is None:
        nbytes = DEFAULT_COPY_BYTES if gpu else CPU_COPY_BYTES
    n = max(nbytes // 4, 1)
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    batch = GPU_BATCH if gpu else 1
    best = float("inf")
    for i in range(repeats + 1):
        if gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(batch):
                torch.mul(src, 1.0, out=dst)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            torch.mul(src, 1.0, out=dst)
            seconds = time.perf_counter() - t0
        if i:  # the first warms the kernel and the pages
            best = min(best, seconds / batch)
    return 2 * 4 * n / best / 1e9


def decode_bound(mf: ModelFile, cfg: ModelConfig, context: int, kv_quant: str,
                 rate_gb_s: float) -> dict[str, Any]:
    """One stream's bound at `context` keys and a memory rate of `rate_gb_s`: the bytes a
    token reads, the rate, and the tokens a second that rate allows."""
    nbytes = decode_read_bytes(mf, cfg, context, kv_quant)
    return {"token_bytes": nbytes, "context": context, "kv_quant": kv_quant,
            "copy_gb_s": round(rate_gb_s, 1),
            "bound_tok_s": round(rate_gb_s * 1e9 / nbytes, 1)}


def share_of_bound(tok_s: float, bound: dict[str, Any]) -> float:
    """tok_s as a percentage of the bound's tokens a second."""
    return round(100.0 * tok_s / bound["bound_tok_s"], 1)


def loaded_bound(loaded: Any, context: int, kv_quant: str) -> dict[str, Any]:
    """decode_bound of an engine's loaded model (engine.loader.LoadedModel), at the rate
    measured on its device (1 GiB on a GPU, 256 MiB on the CPU)."""
    return decode_bound(loaded.file, loaded.config, context, kv_quant,
                        copy_rate_gb_s(loaded.model.device))


def bound_line(tok_s: float, bound: dict[str, Any]) -> str:
    return (f"one stream {tok_s:.1f} tok/s: {share_of_bound(tok_s, bound)}% of its "
            f"bandwidth bound {bound['bound_tok_s']:.1f} tok/s ({bound['token_bytes'] / 1e9:.3f} "
            f"GB a token at {bound['copy_gb_s']:.1f} GB/s copied)")
