"""Stop strings matched across token boundaries.

The text of one request arrives in pieces (one per detokenized token or batch of tokens), so a stop
string may straddle two pieces. `StopMatcher.feed` returns only text that can no longer be part of a
stop string: it holds back the longest suffix that is still the beginning of some stop string, and on
a match it returns the text before the match and reports it. The stop string itself is not shown,
unless the request asked for it (`include`: vLLM's include_stop_str_in_output).

Of several stop strings the one that *ends* first wins (ties: the longer one), which is the one a
token-by-token check would see first; this makes the result depend only on the text, never on how it
was cut into pieces.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class StopResult:
    """What `feed` decided: `text` is safe to show; `matched` is the stop string found (or None)."""

    text: str
    matched: str | None = None


class StopMatcher:
    """Incremental matcher for one request's stop strings (empty strings are ignored)."""

    def __init__(self, stops: Iterable[str], include: bool = False) -> None:
        self.stops: list[str] = sorted({s for s in stops if s}, key=len)
        self.include = include  # a match ends the text rather than being cut from it
        self._pending = ""
        self.done = False

    def __bool__(self) -> bool:
        return bool(self.stops)

    def feed(self, text: str) -> StopResult:
        """Add new text; return the part that is safe to emit now and the stop string if one matched."""
        if self.done:
            return StopResult("")
        if not self.stops:
            return StopResult(text)
        buf = self._pending + text
        hit = self._earliest_match(buf)
        if hit is not None:
            pos, stop = hit
            self._pending = ""
            self.done = True
            return StopResult(buf[: pos + len(stop)] if self.include else buf[:pos], stop)
        keep = self._partial_suffix_len(buf)
        self._pending = buf[len(buf) - keep :] if keep else ""
        return StopResult(buf[: len(buf) - keep])

    def flush(self) -> str:
        """The held-back text, at the end of a request that finished for another reason."""
        out, self._pending = self._pending, ""
        return out

    def _earliest_match(self, buf: str) -> tuple[int, str] | None:
        """(start, stop) of the match that ends first; ties go to the earlier start."""
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            pos = buf.find(stop)
            if pos >= 0:
                key = (pos + len(stop), pos, stop)
                best = key if best is None or key < best else best
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
