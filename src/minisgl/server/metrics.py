"""Prometheus metrics of the API server (`GET /metrics`).

Counted where the API server sees them: a request is "waiting" from its arrival until its first
token and "running" from then until it finishes; token counts come from the workers' replies."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """One registry per server, so two servers (or tests) in one process never share counters."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("minisgl_num_requests_running", "Requests generating tokens", registry=r)
        self.waiting = Gauge(
            "minisgl_num_requests_waiting", "Requests not yet at their first token", registry=r
        )
        self.prompt_tokens = Counter("minisgl_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("minisgl_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "minisgl_requests_finished", "Finished requests", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "minisgl_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "minisgl_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "minisgl_e2e_request_latency_seconds", "Request latency", buckets=_E2E_BUCKETS, registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
