"""Several machines on Kubernetes' LeaderWorkerSet: the same `minisgl serve` command on every pod.

LWS gives each pod of a group LWS_LEADER_ADDRESS (the leader pod's DNS name), LWS_GROUP_SIZE (pods in
the group) and LWS_WORKER_INDEX (0 for the leader). Where they are set, `minisgl serve` takes them as
`--dist-init-addr LEADER:29500`, `--nnodes` and `--node-rank`; a flag given on the command line wins
over its variable. Some of the variables set and others missing (with no flag to stand in) is an
error naming them: a pod guessing its place in a group would hang the group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LEADER, SIZE, INDEX = "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"
# The rendezvous port on the leader when --dist-init-addr is not given (torch.distributed's usual one).
DEFAULT_PORT = 29500

# ServerArgs field -> the variable it is read from.
FIELDS = {"dist_init_addr": LEADER, "nnodes": SIZE, "node_rank": INDEX}


def from_env(given: Mapping[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """The several-machines options for ServerArgs: those in `given` (flags on the command line) as they
    are, the others from LWS's variables in `env`. ValueError naming
    what is missing or malformed. Without any LWS variable, just `given`."""
    present = {name for name in FIELDS.values() if env.get(name, "") != ""}
    if not present:
        return dict(given)
    needed = {var for field, var in FIELDS.items() if field not in given}
    if missing := sorted(needed - present):
        raise ValueError(
            f"LeaderWorkerSet's variables are set only in part ({', '.join(sorted(present))} set, "
            f"{', '.join(missing)} not): set all of {LEADER}, {SIZE}, {INDEX}, or give "
            "--dist-init-addr, --nnodes and --node-rank"
        )
    values = dict(given)
    if "nnodes" not in given:
        values["nnodes"] = _integer(env, SIZE)
    if "node_rank" not in given:
        values["node_rank"] = _integer(env, INDEX)
    if "dist_init_addr" not in given:
        values["dist_init_addr"] = leader_addr(env[LEADER])
    return values


def leader_addr(leader: str) -> str:
    """LWS_LEADER_ADDRESS as HOST:PORT: a name or an IPv4 address gets DEFAULT_PORT, an IPv6 one its
    brackets; one that already ends in :PORT is kept."""
    leader = leader.strip()
    if leader.startswith("[") or (leader.count(":") == 1 and leader.rsplit(":", 1)[1].isdigit()):
        return leader
    return f"[{leader}]:{DEFAULT_PORT}" if ":" in leader else f"{leader}:{DEFAULT_PORT}"


def _integer(env: Mapping[str, str], name: str) -> int:
    text = env[name].strip()
    if not text.isdigit():
        raise ValueError(f"{name} must be a whole number >= 0, got {env[name]!r}")
    return int(text)
