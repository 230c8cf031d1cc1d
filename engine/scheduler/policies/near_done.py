"""Near-done gate: long prefill chunks step aside while a full house waits on a finisher.

When requests wait for a session slot (every slot is taken) and a resident decoder is
within `window` tokens of its max_tokens limit, a long prefill chunk would slow the very
steps that free the next slot. The step then runs decode-only, so the decoder finishes
sooner and the waiting request is admitted sooner. Nothing is evicted, and short chunks
(at most `short_chunk` tokens) still run. After `max_consecutive` yielded steps one long
chunk goes through, so a stream of near-done decoders cannot stall a prefill for good.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.scheduler.sequence import Sequence


class NearDoneGate:
    name = "near_done"

    def __init__(self, window: int = 64, short_chunk: int = 64,
                 max_consecutive: int = 64) -> None:
        self.window = window
        self.short_chunk = short_chunk
        self.max_consecutive = max_consecutive
        self.num_yielded = 0  # consecutive steps in which a long chunk stepped aside

    def near_done(self, decoders: Seq[Sequence]) -> list[Sequence]:
        return [s for s in decoders if s.num_remaining <= self.window]

    def should_yield(self, chunk: int, decoders: Seq[Sequence], num_waiting: int) -> str | None:
        """Why a prefill chunk of `chunk` tokens steps aside this step, or None."""
        if chunk <= self.short_chunk or num_waiting == 0:
            return None
        finishing = self.near_done(decoders)
        if not finishing or self.num_yielded >= self.max_consecutive:
            return None
        return (f"{chunk}-token chunk yields: {num_waiting} waiting for a slot, "
                f"{finishing[0].request_id} has {finishing[0].num_remaining} tokens left")

    def record(self, yielded: bool, ran_prefill: bool) -> None:
        """After planning: count consecutive yields; a prefill that ran resets the count."""
        if ran_prefill:
            self.num_yielded = 0
        elif yielded:
            self.num_yielded += 1
