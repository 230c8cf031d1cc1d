"""ITL target: size each step's prefill chunk so the step (and so every stream's gap
between tokens) stays within a target time.

The cost of a step is modelled as  t = a + b * decode_rows + c * prefill_tokens  and fitted
from the core's measured step times by exponentially weighted least squares (a recursive
fit with forgetting factor `decay`: recent steps count most, the model follows a device
that warms up or throttles). The fit is regularised towards the previous estimate, not
towards zero, so a term that recent steps do not exercise (c during a decode-only stretch)
keeps its last value instead of collapsing.

The chunk is  (target - a - b * decode_rows) / c,  clamped to [min_chunk, prefill_chunk]:
prefill always progresses, even when the decoders alone exceed the target. Before any step
with prefill tokens has been measured the model has no c and the chunk is not capped.
"""

from __future__ import annotations

import math

# Features are scaled to O(1) so that one prior strength suits every term.
_ROW_SCALE = 8.0
_TOKEN_SCALE = 256.0


class StepCostModel:
    def __init__(self, decay: float = 0.9, prior: float = 1e-3) -> None:
        self.decay = decay
        self.prior = prior
        self._g = [[0.0] * 3 for _ in range(3)]  # sum of w * x x^T, x scaled
        self._h = [0.0] * 3  # sum of w * x * seconds
        self._theta = [0.0] * 3  # in scaled units
        self.num_observations = 0
        self.num_prefill_observations = 0

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        x = (1.0, decode_rows / _ROW_SCALE, prefill_tokens / _TOKEN_SCALE)
        for i in range(3):
            self._h[i] = self.decay * self._h[i] + x[i] * seconds
            for j in range(3):
                self._g[i][j] = self.decay * self._g[i][j] + x[i] * x[j]
        self.num_observations += 1
        self.num_prefill_observations += prefill_tokens > 0
        # (G + p I) theta = h + p theta_prev: ridge towards the last estimate.
        m = [[self._g[i][j] + (self.prior if i == j else 0.0) for j in range(3)]
             for i in range(3)]
        rhs = [self._h[i] + self.prior * self._theta[i] for i in range(3)]
        self._theta = _solve3(m, rhs)

    @property
    def is_ready(self) -> bool:
        return self.num_prefill_observations > 0

    def coefficients(self) -> tuple[float, float, float]:
        """(a seconds, b seconds per decode row, c seconds per prefill token)."""
        a, b, c = self._theta
        return a, b / _ROW_SCALE, c / _TOKEN_SCALE

    def predict(self, decode_rows: int, prefill_tokens: int) -> float:
        a, b, c = self.coefficients()
        return a + b * decode_rows + c * prefill_tokens


def _solve3(m: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; m is positive definite (ridge > 0)."""
    a = [row[:] + [r] for row, r in zip(m, rhs, strict=True)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, 3):
            f = a[r][col] / a[col][col]
            for k in range(col, 4):
                a[r][k] -= f * a[col][k]
    x = [0.0] * 3
    for r in range(2, -1, -1):
        x[r] = (a[r][3] - sum(a[r][k] * x[k] for k in range(r + 1, 3))) / a[r][r]
    return x


class ItlTarget:
    name = "itl_target"

    def __init__(self, target_s: float | None, min_chunk: int = 16) -> None:
        self.target_s = target_s  # None: off (the core sets it each step in "auto" mode)
        self.min_chunk = min_chunk
        self.model = StepCostModel()

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float) -> None:
        self.model.observe(decode_rows, prefill_tokens, seconds)

    def chunk_limit(self, decode_rows: int, chunk: int) -> tuple[int, str | None]:
        """The largest chunk (<= `chunk`) that keeps the modelled step within the target,
        and why it was cut (None when it was not)."""
        if self.target_s is None or not self.model.is_ready:
            return chunk, None
        a, b, c = self.model.coefficients()
        base = max(0.0, a + b * decode_rows)
        room = self.target_s - base
        fit = chunk if c <= 0.0 else math.floor(max(0.0, room) / c)
        limit = max(min(self.min_chunk, chunk), min(chunk, fit))
        if limit >= chunk:
            return chunk, None
        return limit, (f"chunk {chunk} -> {limit}: target {self.target_s * 1e3:.2f} ms, "
                       f"{decode_rows} rows {base * 1e3:.2f} ms + {c * 1e6:.2f} us/token")
