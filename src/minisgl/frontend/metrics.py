"""Prometheus metrics of the API server (`GET /metrics`).

Counted where the API server sees them: a request is "waiting" from its arrival until its first
token and "running" from then until it finishes; token counts come from the workers' replies.

The hot path (one observation per generated token) only adds to plain Python numbers; the
Prometheus families are built when /metrics is scraped. prometheus_client's own metric objects take
a lock and make a few checks at every observation, which showed in the serving benchmark's
profile."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    """Bucket counts and a sum; `observe(v, k)` counts the value k times."""

    def __init__(self, name: str, doc: str, buckets: tuple[float, ...]) -> None:
        self.name, self.doc, self.bounds = name, doc, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times

    def family(self) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for bound, c in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            cumulative += c
            buckets.append((bound, cumulative))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class ServerMetrics:
    """One set per server, so two servers (or tests) in one process never share counters."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.cached_prompt_tokens = 0  # prompt tokens the scheduler took from its prefix cache
        self.generation_tokens = 0
        self.finished: Tally[str] = Tally()
        self.ttft = Histogram("minisgl_time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = Histogram("minisgl_inter_token_latency_seconds", "Time between tokens", _LATENCY_BUCKETS)
        self.e2e = Histogram("minisgl_e2e_request_latency_seconds", "Request latency", _E2E_BUCKETS)
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        """The prometheus_client collector protocol."""
        yield GaugeMetricFamily(
            "minisgl_num_requests_running", "Requests generating tokens", value=self.running
        )
        yield GaugeMetricFamily(
            "minisgl_num_requests_waiting", "Requests not yet at their first token", value=self.waiting
        )
        yield CounterMetricFamily(
            "minisgl_prompt_tokens", "Prompt tokens processed", value=self.prompt_tokens
        )
        yield CounterMetricFamily(
            "minisgl_prompt_tokens_cached",
            "Prompt tokens whose KV came from the prefix cache (not prefilled)",
            value=self.cached_prompt_tokens,
        )
        yield GaugeMetricFamily(
            "minisgl_prefix_cache_hit_rate",
            "Cached prompt tokens over prompt tokens, since the server started",
            value=self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        )
        yield CounterMetricFamily(
            "minisgl_generation_tokens", "Tokens generated", value=self.generation_tokens
        )
        finished = CounterMetricFamily(
            "minisgl_requests_finished", "Finished requests", labels=["finish_reason"]
        )
        for reason, n in sorted(self.finished.items()):
            finished.add_metric([reason], n)
        yield finished
        for h in (self.ttft, self.itl, self.e2e):
            yield h.family()

    def render(self) -> bytes:
        return generate_latest(self.registry)
