"""`ReplicaRouter` (--dp): the least loaded replica takes a request, counting what was routed to it
since its last report; ties go to the replica picked longest ago; a report replaces the counts."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from minisgl.frontend.router import ReplicaRouter
from minisgl.message import LoadReply


def test_an_idle_router_deals_round_robin() -> None:
    router = ReplicaRouter(3)
    picks = [router.pick() for _ in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]
    assert router.routed == [3, 2, 2] and router.unreported == [3, 2, 2]


def test_the_least_loaded_replica_takes_the_request() -> None:
    router = ReplicaRouter(3)
    assert router.on_report(LoadReply(replica=0, running=5, waiting=2))
    assert router.on_report(LoadReply(replica=1, running=1, waiting=0))
    assert router.on_report(LoadReply(replica=2, running=3, waiting=0))
    assert [router.load(r) for r in range(3)] == [7, 1, 3]
    assert router.pick() == 1
    assert router.pick() == 1  # load 2 < 3
    assert router.pick() == 2  # 3 vs 3: replica 2 was picked longest ago (never)
    assert router.pick() == 1  # 3 vs 4 vs 7


def test_the_choices_of_one_prompt_stay_together_and_count_as_load() -> None:
    router = ReplicaRouter(2)
    assert router.pick(4) == 0
    assert router.load(0) == 4 and router.routed == [4, 0]
    assert [router.pick() for _ in range(4)] == [1, 1, 1, 1]  # until replica 1 holds as many
    assert router.pick() == 0  # 4 vs 4: replica 0 was picked longer ago


def test_a_report_replaces_the_unreported_count() -> None:
    router = ReplicaRouter(2)
    for _ in range(4):
        router.pick()
    assert router.unreported == [2, 2]
    assert router.on_report(LoadReply(replica=0, running=2, waiting=0))
    assert router.unreported == [0, 2] and router.load(0) == 2
    assert router.on_report(LoadReply(replica=0, running=0, waiting=0))  # they finished
    assert router.pick() == 0
    assert router.routed == [3, 2]  # routed never goes down


def test_reports_from_unknown_replicas_and_negative_counts() -> None:
    router = ReplicaRouter(2)
    assert not router.on_report(LoadReply(replica=2, running=1, waiting=1))
    assert not router.on_report(LoadReply(replica=-1, running=1, waiting=1))
    assert router.running == [0, 0] and router.waiting == [0, 0]
    assert router.on_report(LoadReply(replica=1, running=-3, waiting=-1))
    assert router.load(1) == 0
    with pytest.raises(ValueError, match="num_replicas"):
        ReplicaRouter(0)


def test_metrics_name_each_replica() -> None:
    router = ReplicaRouter(2)
    router.pick()
    router.on_report(LoadReply(replica=1, running=3, waiting=4))
    registry = CollectorRegistry()
    registry.register(router)
    text = generate_latest(registry).decode()
    assert 'minisgl_replica_requests_running{replica="1"} 3.0' in text
    assert 'minisgl_replica_requests_waiting{replica="1"} 4.0' in text
    assert 'minisgl_replica_requests_routed_total{replica="0"} 1.0' in text
    assert 'minisgl_replica_requests_routed_total{replica="1"} 0.0' in text
