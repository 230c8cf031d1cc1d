"""Embeddings of an embedding model: its output-norm states pooled as its GGUF says
(`<arch>.pooling_type`: mean, cls or last), as llama.cpp pools them (Qwen3-Embedding: the
last token's).

A job is a list of token-id inputs. The engine's loop thread runs one chunk of at most the
prefill chunk a turn between its steps (engine.Engine.embed), so a long input never
freezes the model's streams, and takes the waiting clients' inputs in turn (`next_job`),
so one client's thousand documents do not hold back another's query. An input's pages
come from the sequences' pool and go back as soon as it is done; none enters the prefix
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
    client_id: str = "local"  # whose: the loop takes clients' inputs in turn
    vectors: list[torch.Tensor] = field(default_factory=list)  # (hidden,) float32, CPU
    run: PoolingRun | None = None  # the input under way


def next_job(jobs: list[EmbedJob], last_client: str | None) -> int:
    """The index of the job whose next input runs: the one under way, else the first job
    of the first client after `last_client` in order of their first jobs (round robin)."""
    for i, job in enumerate(jobs):
        if job.run is not None:
            return i
    clients = list(dict.fromkeys(job.client_id for job in jobs))
    if last_client in clients:
        at = clients.index(last_client) + 1
        clients = clients[at:] + clients[:at]
    return next(i for i, job in enumerate(jobs) if job.client_id == clients[0])


class PoolingRun:
    """One input's pooling, a chunk a `step` (so the engine's steps go on between)."""

    def __init__(self, runner: Any, ids: list[int], pooling: str, chunk: int) -> None:
        if pooling not in POOLINGS:
            raise InvalidRequest(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        if not ids:
            raise InvalidRequest("an input has no tokens")
        self.runner, self.ids, self.pooling, self.chunk = runner, ids, pooling, chunk
        self.seq = SeqPages(runner.pool)
        self.pos = 0
        self.total: torch.Tensor | None = None  # float64: the sum (mean) or the state

    def step(self) -> torch.Tensor | None:
        """Run the next chunk; -> (hidden,) float32 on the CPU, not normalized, after the
        last (its pages freed), else None. OutOfKVPages: no page free now (retry later)."""
        lo, pooling = self.pos, self.pooling
        part = self.ids[lo:lo + self.chunk]
        self.seq.ensure(lo + len(part))
        tables = {g: [self.seq.table(g)] for g in self.runner.pool.groups}
        rows = None  # the chunk's last token
        if pooling == "mean":
            rows = list(range(len(part)))
        elif pooling == "cls":
            rows = [0]
        h = self.runner.hidden_states(ForwardBatch.build([(part, lo)], tables, rows))
        self.pos += len(part)
        if pooling == "mean":
            part_sum = h.double().sum(dim=0)
            self.total = part_sum if self.total is None else self.total + part_sum
        else:
            self.total = h[0 if pooling == "cls" else -1].double()
        # cls: causal, so the first token's state sees no later one
        if self.pos < len(self.ids) and pooling != "cls":
            return None
        self.close()
        assert self.total is not None
        out = self.total / len(self.ids) if pooling == "mean" else self.total
        return out.float().cpu()

    def close(self) -> None:
        self.seq.free()
