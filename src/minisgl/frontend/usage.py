"""One request's token counts and the latency metrics they feed (time to first token, inter-token
latency, end to end): what the usage of an answer reports and /metrics aggregates."""

from __future__ import annotations

import time
from collections.abc import Callable

from minisgl.frontend.metrics import ServerMetrics


class StreamUsage:
    """Prompt, completion and cached-prompt token counts of one request as its replies arrive, each
    change counted into the server's metrics once. `on_first_token` runs when output begins."""

    def __init__(self, metrics: ServerMetrics, on_first_token: Callable[[], None]) -> None:
        self.metrics = metrics
        self.on_first_token = on_first_token
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the scheduler took from its prefix cache
        self.acked = False  # the tokenizer's prompt-token count arrived
        self.t_start = time.perf_counter()
        self._t_last: float | None = None

    def count_prompt(self, prompt_tokens: int) -> None:
        """The tokenizer's prompt-token count (in its first reply), taken once."""
        if prompt_tokens and not self.acked:
            self.acked = True
            self.prompt_tokens = prompt_tokens
            self.metrics.prompt_tokens += prompt_tokens

    def count_tokens(self, total: int) -> None:
        """`total` completion tokens so far: the new ones go into TTFT / ITL and the token counter."""
        new = total - self.completion_tokens
        if new <= 0:
            return
        now = time.perf_counter()
        m = self.metrics
        if self._t_last is None:
            m.ttft.observe(now - self.t_start)
            self.on_first_token()
            new_itl, gap = new - 1, 0.0
        else:
            new_itl, gap = new, (now - self._t_last) / new
        if new_itl:
            m.itl.observe(gap, new_itl)
        m.generation_tokens += new
        self._t_last = now
        self.completion_tokens = total

    def count_cached(self, cached: int) -> None:
        if cached > self.cached_tokens:
            self.metrics.cached_prompt_tokens += cached - self.cached_tokens
            self.cached_tokens = cached

    def finished(self, reason: str) -> None:
        self.metrics.finished[reason] += 1
        self.metrics.e2e.observe(time.perf_counter() - self.t_start)
