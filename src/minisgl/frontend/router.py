"""--dp M: which data-parallel replica takes a new request.

Each replica's scheduler rank 0 reports its load (running and waiting requests) in a `LoadMsg`
whenever the counts change; it rides with that step's replies and reaches here as a `LoadReply`.
A request goes to the replica with the least load, counting as load also the requests routed to
it since its last report (which that report may not include yet); a report replaces both. Ties go
to the replica that was picked longest ago, so an idle server deals requests round robin.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from minisgl.message import LoadReply


class ReplicaRouter:
    """The router's view of `num_replicas` replicas (also a prometheus_client collector)."""

    def __init__(self, num_replicas: int = 1) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        self.running = [0] * num_replicas  # as last reported
        self.waiting = [0] * num_replicas
        self.unreported = [0] * num_replicas  # routed since the replica's last report
        self.routed = [0] * num_replicas  # requests (choices) routed, since the start
        self._last_pick = [-1] * num_replicas
        self._picks = 0

    @property
    def num_replicas(self) -> int:
        return len(self.running)

    def load(self, replica: int) -> int:
        return self.running[replica] + self.waiting[replica] + self.unreported[replica]

    def pick(self, count: int = 1) -> int:
        """The replica for `count` requests (the choices of one prompt stay together)."""
        best = min(range(self.num_replicas), key=lambda r: (self.load(r), self._last_pick[r]))
        self.unreported[best] += count
        self.routed[best] += count
        self._last_pick[best] = self._picks
        self._picks += 1
        return best

    def on_report(self, msg: LoadReply) -> bool:
        """Take a replica's report; False (ignored) for a replica that does not exist."""
        r = msg.replica
        if not 0 <= r < self.num_replicas:
            return False
        self.running[r], self.waiting[r] = max(msg.running, 0), max(msg.waiting, 0)
        self.unreported[r] = 0
        return True

    def collect(self) -> Iterator[Metric]:
        """Per-replica families for /metrics (label `replica`)."""
        families = (
            (GaugeMetricFamily, "minisgl_replica_requests_running", "Requests running, as the replica reports", self.running),
            (GaugeMetricFamily, "minisgl_replica_requests_waiting", "Requests waiting for KV pages, as the replica reports", self.waiting),
            (CounterMetricFamily, "minisgl_replica_requests_routed", "Requests routed to the replica", self.routed),
        )  # fmt: skip
        for cls, name, doc, values in families:
            family = cls(name, doc, labels=["replica"])
            for r, v in enumerate(values):
                family.add_metric([str(r)], v)
            yield family
