"""Several machines (--nnodes N --node-rank K --dist-init-addr HOST:PORT).

The dp x tp ranks are spread contiguously: node K runs global ranks K x R .. (K+1) x R - 1
(R = dp x tp / N; global rank = replica x tp + tensor-parallel rank). Node 0 also runs the API server,
the tokenizer(s) and the detokenizer, and hosts, bound to HOST:PORT only, the torch.distributed
store every rank of every replica meets on (a key prefix per replica) and that the nodes' launchers
use to talk (a key prefix "minisgl/"):

- `addrs`: JSON, from node 0: the tcp endpoints node 0 binds on HOST for replicas whose rank 0 is on
  another node (one per tokenizer process and replica for requests, one for every reply);
- `node{K}/ready`, `node{K}/failed` (why), `node{K}/beat` (a counter each launcher bumps every
  second); `stop` or `failed` from node 0.

Every launcher watches the others: a failure key, a heartbeat that stops for _STALE_S, or the store
itself gone (node 0 died) stops the node with an error naming the rank or node. A tensor-parallel
group that spans machines forwards its messages over tcp (rank 0 binds its own machine's address
facing node 0, never every interface).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import TYPE_CHECKING

from minisgl.launch.args import ServerArgs, split_host_port

if TYPE_CHECKING:
    import torch.distributed as dist

    from minisgl.scheduler.config import SchedulerConfig

_STALE_S = 10.0  # a node whose heartbeat has not moved for this long is taken for dead
_BEAT_S = 1.0


@dataclasses.dataclass(frozen=True)
class TcpPlan:
    """The endpoints node 0 binds on HOST for replicas whose rank 0 is on another node."""

    detokenizer: str  # every remote replica's replies ("" when none is remote)
    backend: dict[int, list[str]]  # replica -> one endpoint per tokenizing process

    def to_json(self) -> str:
        return json.dumps({"detokenizer": self.detokenizer, "backend": self.backend})

    @staticmethod
    def from_json(text: str) -> TcpPlan:
        d = json.loads(text)
        return TcpPlan(d["detokenizer"], {int(r): list(a) for r, a in d["backend"].items()})


def node_of(args: ServerArgs, global_rank: int) -> int:
    return global_rank // args.ranks_per_node


def remote_replicas(args: ServerArgs) -> list[int]:
    """Replicas whose rank 0 is not on node 0."""
    return [r for r in range(args.dp) if node_of(args, r * args.tp) != 0]


def make_plan(args: ServerArgs) -> TcpPlan:
    from minisgl.utils.host import find_free_port

    host, _ = split_host_port(args.dist_init_addr or "")
    remote = remote_replicas(args)
    tokenizers = max(1, args.num_tokenizer)

    def endpoint() -> str:
        return f"tcp://{_bracket(host)}:{find_free_port(host)}"

    return TcpPlan(
        detokenizer=endpoint() if remote else "",
        backend={r: [endpoint() for _ in range(tokenizers)] for r in remote},
    )


def node_configs(base: SchedulerConfig, args: ServerArgs, plan: TcpPlan) -> list[SchedulerConfig]:
    """The SchedulerConfigs of the ranks on this node (--node-rank), every replica on the shared store."""
    from minisgl.launch.configs import replica_configs

    host, port = split_host_port(args.dist_init_addr or "")
    configs = []
    for replica in range(args.dp):
        first = replica * args.tp
        spans = node_of(args, first) != node_of(args, first + args.tp - 1)
        rep = dataclasses.replace(
            base,
            replica=replica,
            dist_init_addr=f"tcp://{_bracket(host)}:{port}",
            dist_store_prefix=f"replica{replica}/",
            backend_tcp_addrs=tuple(plan.backend.get(replica, ())),
            detokenizer_tcp_addr=plan.detokenizer if replica in plan.backend else "",
            broadcast_over_tcp=spans,
        )
        configs += [
            c for k, c in enumerate(replica_configs(rep, args)) if node_of(args, first + k) == args.node_rank
        ]
    return configs


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class NodeLink:
    """One launcher's view of the others, through node 0's store."""

    def __init__(self, store: dist.Store, args: ServerArgs) -> None:
        import torch.distributed as dist

        self.store = dist.PrefixStore("minisgl/", store)
        self.args = args
        self._beats: dict[int, tuple[int, float]] = {}
        self._last_beat = 0.0

    @staticmethod
    def connect(args: ServerArgs, timeout_s: float) -> NodeLink:
        import torch.distributed as dist

        host, port = split_host_port(args.dist_init_addr or "")
        store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))
        return NodeLink(store, args)

    def set(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def beat(self) -> None:
        """Bump this node's heartbeat (at most once a second)."""
        now = time.monotonic()
        if now - self._last_beat >= _BEAT_S:
            self.store.add(f"node{self.args.node_rank}/beat", 1)
            self._last_beat = now

    def problem(self) -> str | None:
        """Why this node must stop, if another node failed, stopped beating or (from node 0) stopped."""
        for key, what in (("failed", "node 0 failed: "), ("stop", "node 0 stopped: ")):
            value = self.get(key)
            if value is not None:
                return what + value
        for k in range(self.args.nnodes):
            if k == self.args.node_rank:
                continue
            failed = self.get(f"node{k}/failed")
            if failed is not None:
                return f"node {k}: {failed}"
            if self.get(f"node{k}/ready") is not None and self._stale(k):
                return f"node {k} stopped responding (no heartbeat for {_STALE_S:g} s)"
        return None

    def _stale(self, k: int) -> bool:
        count = self.store.add(f"node{k}/beat", 0)
        now = time.monotonic()
        seen, since = self._beats.get(k, (-1, now))
        if count != seen:
            self._beats[k] = (count, now)
            return False
        return now - since > _STALE_S

    def all_ready(self) -> bool:
        return all(self.get(f"node{k}/ready") is not None for k in range(1, self.args.nnodes))
