"""First-token burst: a short prompt is prefilled in one step even past the ITL target,
within a small tail budget.

The ITL target is a 95th-percentile promise: the streams' gaps stay within it on at least
95% of the steps. Beside streaming decoders the target cuts a short request's prompt into
several small chunks, so its first token waits several steps (on a slow CPU a 128-token
prompt takes 4-6 steps beside three streams, small chunks being the least efficient),
although finishing it in one longer step would cost the streams a single longer gap.
This policy spends the tail that the percentile leaves on exactly that: a prompt whose
whole length is at most `max_tokens` and whose remaining prefill fits, by the cost model,
within `max_factor` times the target takes it all in one step, as long as at most
`tail_share` (4.5%) of the last `window` steps with streams went over the target, bursts
included. The ITL target's margin aims 98% of steps under the target, so the bursts use
what is left of the 5%.
"""

from __future__ import annotations

from collections import deque


class FirstTokenBurst:
    name = "first_token_burst"

    def __init__(self, max_tokens: int = 512, max_factor: float = 3.0,
                 tail_share: float = 0.045, window: int = 200) -> None:
        self.max_tokens = max_tokens
        self.max_factor = max_factor
        self.tail_share = tail_share
        self._over: deque[bool] = deque(maxlen=window)  # steps with streams: over target?
        self._pending = 0  # bursts granted in the step being planned
        self.num_bursts = 0

    def observe(self, decode_rows: int, seconds: float, target_s: float | None) -> None:
        """A measured step; only steps with streams and a target count."""
        if decode_rows and target_s is not None:
            self._over.append(seconds > target_s or self._pending > 0)
        self._pending = 0

    def budget_left(self) -> bool:
        """Whether one more over-target step keeps the window's share within `tail_share`."""
        window = self._over.maxlen or 1
        return sum(self._over) + (self._pending == 0) <= self.tail_share * window

    def eligible(self, num_prompt: int, num_uncomputed: int) -> bool:
        return num_prompt <= self.max_tokens and num_uncomputed <= self.max_tokens

    def allows(self, modelled_s: float, target_s: float) -> bool:
        """A burst of `modelled_s` (the step with the whole remaining prompt) may run."""
        return modelled_s <= self.max_factor * target_s and self.budget_left()

    def record(self) -> None:
        self._pending += 1
        self.num_bursts += 1
