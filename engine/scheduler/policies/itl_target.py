"""ITL target: size each step's prefill chunk so the step (and so every stream's gap
between tokens) stays within a target time.

The cost of a step is modelled as

    t = a + b * decode_rows + c * prefill_tokens + d * attended

where `attended` = prefill_tokens * (start + prefill_tokens / 2) counts the key reads of
the chunk's attention (a chunk deep into a long prompt attends to everything before it,
so its cost per token grows with its start). The model is fitted from the core's measured
step times by exponentially weighted least squares (forgetting factor `decay`: recent
steps count most, the model follows a device that warms up or throttles), regularised
towards the previous estimate, so a term that recent steps do not exercise keeps its last
value instead of collapsing.

The chunk is the largest n whose modelled step fits the target, clamped to
[min_chunk, prefill_chunk]: prefill always progresses, even when the decoders alone exceed
the target. Beside streaming decoders the model never extrapolates far: a step's prefill
tokens stay within `growth` times the most that one of the last 64 steps beside decoders
carried (at least `probe_chunk`; before any measurement, that small probe), so a model
fitted on small steps cannot allow a chunk many times larger and cause a stall; the
allowed size doubles step by step as larger steps are measured. Predictions also never
use a negative coefficient: steps stuck at one chunk size hardly vary the token count,
and a fit on them can make a long chunk look free.

The model predicts a step's mean time; measured steps scatter around it (cache state,
the OS, allocation), so a chunk sized to the mean would overshoot the target on about half
of the steps. The policy therefore scales its prediction by a margin: the `quantile` of
measured/modelled time over the last `window` steps that carried prefill beside decoders
(1 when within 2%, at most `max_margin`), so that about that share of steps stays within the
target. On exact costs the margin is 1.

A stall is not a cost: a step that takes more than STALL_FACTOR times its prediction (and
STALL_MIN_S longer) once the model has seen enough steps (a kernel built at first use, a
page-fault storm, a collector pause) stays out of the fit and the margin's window, unless
it is the third such step in a row (then costs really changed). And one step alone never
sets the margin: it reads at most the second-largest ratio of its window.

A step may carry several prefill rows (engine/scheduler/prefill.py packs them): their
tokens and attended keys add up (`PrefillLoad`), and each further row gets the largest
chunk that still fits beside what the step already carries; only the step's first row is
clamped up to `min_chunk`.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

MARGIN_TOLERANCE = 0.02  # measured/modelled quantiles up to 1.02 leave the margin at 1
STALL_FACTOR = 4.0  # measured / modelled above this (and STALL_MIN_S over) is a stall
STALL_MIN_S = 0.02
STALL_MIN_OBSERVATIONS = 8  # the fit judges stalls only after this many steps
STALL_MAX_RUN = 2  # consecutive stalls left out; the next slow step is taken as a trend
# Features are scaled to O(1) so that one prior strength suits every term.
_SCALES = (1.0, 8.0, 256.0, 256.0 * 2048.0)


class PrefillLoad(NamedTuple):
    """The prefill rows of one step: their tokens and the keys their attention reads."""

    tokens: int = 0
    attended: float = 0.0

    def plus(self, num: int, start: int) -> PrefillLoad:
        """With one more row of `num` tokens starting at position `start`: its token at
        position p reads p + 1 keys, ~ num * (start + num / 2) in all."""
        return PrefillLoad(self.tokens + num, self.attended + num * (start + num / 2))


NO_PREFILL = PrefillLoad()


class StepCostModel:
    def __init__(self, decay: float = 0.9, prior: float = 1e-3) -> None:
        self.decay = decay
        self.prior = prior
        n = len(_SCALES)
        self._g = [[0.0] * n for _ in range(n)]  # sum of w * x x^T, x scaled
        self._h = [0.0] * n  # sum of w * x * seconds
        self._theta = [0.0] * n  # in scaled units
        self.num_observations = 0
        self.num_prefill_observations = 0
        self.max_prefill_tokens_ever = 0  # the most prefill tokens one observed step carried

    @staticmethod
    def features(decode_rows: int, load: PrefillLoad) -> list[float]:
        raw = (1.0, decode_rows, load.tokens, load.attended)
        return [v / s for v, s in zip(raw, _SCALES, strict=True)]

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float,
                start: int = 0) -> None:
        """A step with one prefill row of `prefill_tokens` starting at `start`."""
        self.observe_load(decode_rows, NO_PREFILL.plus(prefill_tokens, start), seconds)

    def observe_load(self, decode_rows: int, load: PrefillLoad, seconds: float) -> None:
        x = self.features(decode_rows, load)
        n = len(x)
        for i in range(n):
            self._h[i] = self.decay * self._h[i] + x[i] * seconds
            for j in range(n):
                self._g[i][j] = self.decay * self._g[i][j] + x[i] * x[j]
        self.num_observations += 1
        self.num_prefill_observations += load.tokens > 0
        self.max_prefill_tokens_ever = max(self.max_prefill_tokens_ever, load.tokens)
        # (G + p I) theta = h + p theta_prev: ridge towards the last estimate.
        m = [[self._g[i][j] + (self.prior if i == j else 0.0) for j in range(n)]
             for i in range(n)]
        rhs = [self._h[i] + self.prior * self._theta[i] for i in range(n)]
        self._theta = _solve(m, rhs)

    @property
    def is_ready(self) -> bool:
        return self.num_prefill_observations > 0

    def coefficients(self) -> tuple[float, ...]:
        """(a s, b s per decode row, c s per prefill token, d s per attended key)."""
        return tuple(t / s for t, s in zip(self._theta, _SCALES, strict=True))

    def predict(self, decode_rows: int, prefill_tokens: int, start: int = 0) -> float:
        return self.predict_load(decode_rows, NO_PREFILL.plus(prefill_tokens, start))

    def predict_load(self, decode_rows: int, load: PrefillLoad) -> float:
        """A negative fitted coefficient (noise on steps that hardly vary a feature) counts
        as 0: more work never predicts less time, so a chunk far beyond what was measured
        cannot look free."""
        x = self.features(decode_rows, load)
        return sum(max(t, 0.0) * v for t, v in zip(self._theta, x, strict=True))


def _solve(m: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; m is positive definite (ridge > 0)."""
    n = len(rhs)
    a = [row[:] + [r] for row, r in zip(m, rhs, strict=True)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


class ItlTarget:
    name = "itl_target"

    def __init__(self, target_s: float | None, min_chunk: int = 16,
                 probe_chunk: int = 64, growth: int = 2, quantile: float = 0.98,
                 window: int = 64, max_margin: float = 2.0) -> None:
        self.target_s = target_s  # None: off (the core sets it each step in "auto" mode)
        self.min_chunk = min_chunk
        self.probe_chunk = probe_chunk
        self.growth = growth
        self.quantile = quantile
        self.max_margin = max_margin
        self.model = StepCostModel()
        # the recent steps with prefill beside decoders: (rows, load, seconds)
        self._recent: deque[tuple[int, PrefillLoad, float]] = deque(maxlen=window)
        # the prefill tokens of recent such steps that replayed a captured graph
        self._replayed: deque[int] = deque(maxlen=window)
        self._margin: tuple[int, float] = (-1, 1.0)  # (observations when computed, margin)
        self.num_stalls = 0  # steps left out as stalls
        self._stall_run = 0  # consecutive stalls just left out

    def observe(self, decode_rows: int, prefill_tokens: int, seconds: float,
                start: int = 0) -> None:
        self.observe_load(decode_rows, NO_PREFILL.plus(prefill_tokens, start), seconds)

    def observe_load(self, decode_rows: int, load: PrefillLoad, seconds: float) -> None:
        if self.is_stall(decode_rows, load, seconds) and self._stall_run < STALL_MAX_RUN:
            self.num_stalls += 1
            self._stall_run += 1
            return
        self._stall_run = 0
        if load.tokens and decode_rows:
            self._recent.append((decode_rows, load, seconds))
        self.model.observe_load(decode_rows, load, seconds)

    def is_stall(self, decode_rows: int, load: PrefillLoad, seconds: float) -> bool:
        """Whether a step of `seconds` is far beyond what the fitted model predicts."""
        if self.model.num_observations < STALL_MIN_OBSERVATIONS:
            return False
        predicted = self.model.predict_load(decode_rows, load)
        return seconds > STALL_FACTOR * predicted and seconds - predicted > STALL_MIN_S

    def note_replayed(self, decode_rows: int, prefill_tokens: int) -> None:
        """A step with prefill that replayed a captured graph (engine/mixed_graphs.py):
        its chunk counts toward the ceiling, so chunks beside decoders keep growing while
        such steps replay, but not toward the cost model, which predicts eager steps, nor
        the margin."""
        if prefill_tokens and decode_rows:
            self._replayed.append(prefill_tokens)

    def max_recent_prefill(self) -> int:
        """The most prefill tokens one of the recent steps beside decoders carried (eager
        or replayed)."""
        return max(max((load.tokens for _, load, _ in self._recent), default=0),
                   max(self._replayed, default=0))

    def recent_steps(self) -> list[tuple[int, int, float, float]]:
        """The recent steps with prefill beside decoders as (decode rows, prefill tokens,
        measured s, modelled s without the margin), oldest first: what the margin reads."""
        return [(rows, load.tokens, t, self.model.predict_load(rows, load))
                for rows, load, t in self._recent]

    def margin(self) -> float:
        """The factor on modelled step times: the `quantile` of measured/modelled time over
        the recent mixed steps (judged by the current model, so the errors of a model still
        converging do not linger), clamped to [1, max_margin]."""
        seen = self.model.num_observations
        if self._margin[0] != seen:
            ratios = sorted(t / m for _, _, t, m in self.recent_steps() if m > 0)
            # the quantile, but never the largest ratio alone (one step is not a spread)
            top = len(ratios) - (2 if len(ratios) > 1 else 1)
            q = ratios[min(top, int(self.quantile * len(ratios)))] if ratios else 1.0
            # within the fit's own tolerance the model is taken as exact
            self._margin = (seen, 1.0 if q <= 1.0 + MARGIN_TOLERANCE else min(self.max_margin, q))
        return self._margin[1]

    def ceiling(self) -> int:
        """The most prefill tokens a step beside streaming decoders may carry: `growth`
        times the most that a recent step beside decoders carried (the probe before any)."""
        return max(self.probe_chunk, self.growth * self.max_recent_prefill())

    def modelled(self, decode_rows: int, load: PrefillLoad) -> float | None:
        """The step's modelled time with the margin (None: off, or nothing measured)."""
        if self.target_s is None or not self.model.is_ready:
            return None
        return self.margin() * self.model.predict_load(decode_rows, load)

    def burst_ceiling(self) -> int:
        """The most prefill tokens a first-token burst may put in one step: `growth` times
        the most any measured step carried (with or without decoders), so the model's
        prediction of it rests on steps of that size."""
        return self.growth * self.model.max_prefill_tokens_ever

    def chunk_limit(self, decode_rows: int, chunk: int, start: int = 0,
                    load: PrefillLoad = NO_PREFILL) -> tuple[int, str | None]:
        """The largest chunk (<= `chunk`) starting at position `start` that keeps the
        modelled step, beside the prefill rows already in it (`load`), within the target,
        and why it was cut (None when it was not). The step's first row gets at least
        `min_chunk`; a further row may get 0 (the step is full)."""
        if self.target_s is None:
            return chunk, None
        room = max(0, min(chunk, self.ceiling() - load.tokens))
        if not self.model.is_ready:
            return room, (None if room == chunk else f"chunk {chunk} -> {room}: probe")
        why = None if room == chunk else (
            f"chunk {chunk} -> {room}: at most {self.ceiling()} prefill tokens a step "
            f"({self.growth}x the most of a recent step)")

        margin = self.margin()

        def cost(n: int) -> float:
            return margin * self.model.predict_load(decode_rows, load.plus(n, start))

        if cost(room) <= self.target_s:
            return room, why
        lo, hi = (min(self.min_chunk, room) if load.tokens == 0 else 0), room
        while lo < hi:  # the modelled time grows with the chunk: bisect for the largest fit
            mid = (lo + hi + 1) // 2
            if cost(mid) <= self.target_s:
                lo = mid
            else:
                hi = mid - 1
        return lo, (f"chunk {chunk} -> {lo}: target {self.target_s * 1e3:.2f} ms, "
                    f"{decode_rows} rows, {load.tokens} prefill tokens before, "
                    f"modelled {cost(lo) * 1e3:.2f} ms (margin {margin:.2f})")
