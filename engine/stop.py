"""Stop handling: stop strings, stop token ids, end-of-generation ids and max_tokens.

Fed one token at a time with its decoded text delta, StopChecker says which text may be
streamed now. Text that could still be the start of a stop string is held back until the
next delta decides it; a matched stop string and everything after it is never emitted
(vLLM's default, include_stop_str_in_output=False). When several stop strings are complete
at the same step, the one that starts first wins. A stop or EOG token's own text is not
emitted (its delta is usually an empty or special piece). Precedence on one token: stop
token id / EOG, then stop string, then max_tokens ("stop" beats "length", as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine.errors import InvalidRequest

__all__ = ["StopChecker", "StopUpdate"]


class StopUpdate(NamedTuple):
    text: str  # text that may be streamed now
    finish_reason: str | None  # "stop" | "length" | None
    stop_reason: str | int | None = None  # the stop string or token id that matched


class StopChecker:
    """Per-sequence stop state. After a finish_reason is returned, feed() must not be called."""

    def __init__(
        self,
        stop: Sequence[str],
        stop_token_ids: Sequence[int],
        eog_ids: frozenset[int],
        ignore_eos: bool,
        max_tokens: int | None,
    ) -> None:
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}")
        self.stop_strings = tuple(s for s in stop if s)
        # ignore_eos turns EOG ids into ordinary tokens; explicit stop_token_ids still stop.
        self.stop_ids = frozenset(stop_token_ids) | (frozenset() if ignore_eos else eog_ids)
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self._held = ""  # text not yet emitted: a suffix that may start a stop string

    @property
    def held_text(self) -> str:
        return self._held

    def feed(self, token_id: int, text_delta: str) -> StopUpdate:
        """One new token and the text it added; returns what may be emitted now."""
        assert self.finish_reason is None, "feed() after the sequence finished"
        self.num_tokens += 1
        if token_id in self.stop_ids:
            return self._finish(self._take(len(self._held)), "stop", token_id)
        buffer = self._held + text_delta
        match = self._first_stop(buffer)
        if match is not None:
            start, string = match
            self._held = ""
            return self._finish(buffer[:start], "stop", string)
        self._held = buffer
        if self.max_tokens is not None and self.num_tokens >= self.max_tokens:
            return self._finish(self._take(len(buffer)), "length", None)
        keep = self._partial_suffix_len(buffer)
        return StopUpdate(self._take(len(buffer) - keep), None)

    def flush(self) -> str:
        """Release held-back text when the sequence ends for another reason (abort, grammar)."""
        return self._take(len(self._held))

    def _finish(self, text: str, reason: str, stop_reason: str | int | None) -> StopUpdate:
        self.finish_reason = reason
        return StopUpdate(text, reason, stop_reason)

    def _take(self, n: int) -> str:
        text, self._held = self._held[:n], self._held[n:]
        return text

    def _first_stop(self, buffer: str) -> tuple[int, str] | None:
        """Earliest complete stop string in buffer (held text + new delta), if any.

        Emitted text never holds the start of a stop string (see _partial_suffix_len), so
        searching the buffer finds every match.
        """
        best: tuple[int, str] | None = None
        for string in self.stop_strings:
            start = buffer.find(string)
            if start >= 0 and (best is None or start < best[0]):
                best = (start, string)
        return best

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop string."""
        longest = 0
        for string in self.stop_strings:
            for n in range(min(len(string) - 1, len(buffer)), longest, -1):
                if buffer.endswith(string[:n]):
                    longest = n
                    break
        return longest
