"""Embeddings of an embedding model: its output-norm states pooled as its GGUF says
(`<arch>.pooling_type`: mean, cls or last), as llama.cpp pools them (Qwen3-Embedding: the
last token's).

A job is a list of token-id inputs. The engine's loop thread runs one input a turn between
its steps (engine.Engine.embed), in chunks of at most the prefill chunk, through pages of
the sequences' pool that go back as soon as the input is done; no page enters the prefix
cache. An input runs alone, so its vector does not depend on what else is served.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.batch import ForwardBatch
from engine.errors import InvalidRequest
from engine.kv.pool import SeqPages

POOLINGS = ("mean", "cls", "last")


@dataclass(slots=True)
class EmbedJob:
    inputs: list[list[int]]
    done: Callable[[list[torch.Tensor] | BaseException], None]  # called once, any thread
    vectors: list[torch.Tensor] = field(default_factory=list)  # (hidden,) float32, CPU


def pooled(runner: Any, ids: list[int], pooling: str, chunk: int) -> torch.Tensor:
    """(hidden,) float32 on the CPU: the pooled output-norm states of `ids`, not
    normalized. Raises OutOfKVPages when the pool has no room for the input now."""
    if pooling not in POOLINGS:
        raise InvalidRequest(f"pooling must be one of {POOLINGS}, got {pooling!r}")
    if not ids:
        raise InvalidRequest("an input has no tokens")
    seq = SeqPages(runner.pool)
    total: torch.Tensor | None = None
    try:
        for lo in range(0, len(ids), chunk):
            part = ids[lo:lo + chunk]
            seq.ensure(lo + len(part))
            tables = {g: [seq.table(g)] for g in runner.pool.groups}
            rows = None  # the chunk's last token
            if pooling == "mean":
                rows = list(range(len(part)))
            elif pooling == "cls":
                rows = [0]
            h = runner.hidden_states(ForwardBatch.build([(part, lo)], tables, rows))
            if pooling == "mean":
                part_sum = h.double().sum(dim=0)
                total = part_sum if total is None else total + part_sum
            elif pooling == "cls":  # causal: the first token's state sees no other
                total = h[0].double()
                break
            else:
                total = h[-1].double()
    finally:
        seq.free()
    assert total is not None
    if pooling == "mean":
        total = total / len(ids)
    return total.float().cpu()
