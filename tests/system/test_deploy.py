"""deploy/ and docker/: the Kubernetes manifests against the Kubernetes API's schemas (the ones the
kubernetes-validate package ships, strict: an unknown field is an error; offline), LeaderWorkerSet's
own fields checked by hand (its schema is a CRD's, not shipped) and its pod templates against the
core schema; then what the files mean for minisgl: every container command, the systemd unit's
ExecStart and the images' CMD parse as `minisgl serve` flags (with LWS's variables for each pod of
a group), the probes hit /health on the served port, and each grace period outlasts the drain."""

from __future__ import annotations

import configparser
import json
import shlex
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from minisgl.cli.main import build_parser
from minisgl.launch.args import ServerArgs, args_from_namespace

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"  # of the schemas checked against (Kubernetes releases are supported ~14 months)
DOCKER_STOP_GRACE_S = 10  # `docker stop`'s default
# LeaderWorkerSet v1's fields that the manifest uses may be only these (kubernetes-sigs/lws's API).
LWS_SPEC = {"replicas", "leaderWorkerTemplate", "rolloutStrategy", "startupPolicy", "networkConfig"}
LWS_TEMPLATE = {"size", "restartPolicy", "leaderTemplate", "workerTemplate", "subGroupPolicy"}
LWS_RESTART = {"RecreateGroupOnPodRestart", "None"}


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _validate(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _pod_template(template: dict[str, Any]) -> dict[str, Any]:
    """A pod template inside a custom resource, as the core PodTemplate object the schemas know."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}


def _serve_args(argv: list[str], env: dict[str, str] | None = None) -> ServerArgs:
    assert argv[0] == "serve", argv
    return args_from_namespace(build_parser().parse_args(argv), env or {})


def _pre_stop_s(container: dict[str, Any]) -> float:
    command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command")
    if command is None:
        return 0.0
    assert command[0] == "sleep", command
    return float(command[1])


def _check_probes(container: dict[str, Any], args: ServerArgs) -> None:
    """Readiness, liveness and start-up on /health at the served port; the liveness probe gives the
    server's own watchdog time to act first, the start-up probe the launcher's --startup-timeout."""
    (port,) = [p for p in container["ports"] if p["name"] == "http"]
    assert port["containerPort"] == args.port
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        probe = container[kind]
        assert probe["httpGet"] == {"path": "/health", "port": "http"}, kind
    live, start = container["livenessProbe"], container["startupProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > args.watchdog_timeout
    assert start["periodSeconds"] * start["failureThreshold"] >= args.startup_timeout


def _check_grace(pod: dict[str, Any], container: dict[str, Any], args: ServerArgs) -> None:
    drain = _pre_stop_s(container) + args.shutdown_timeout
    assert pod["terminationGracePeriodSeconds"] > drain + 2, "no room for the processes to exit"


def test_single_replica_manifest() -> None:
    deployment, service = _documents(KUBE / "minisgl.yaml")
    for doc in (deployment, service):
        _validate(doc)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = _serve_args(container["args"])
    assert args.host == "0.0.0.0"  # reachable from the Service
    _check_probes(container, args)
    _check_grace(pod, container, args)
    assert _pre_stop_s(container) > 0
    assert pod["securityContext"]["runAsNonRoot"] is True
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def test_leaderworkerset_manifest() -> None:
    lws, service = _documents(KUBE / "minisgl-lws.yaml")
    _validate(service)
    assert (lws["apiVersion"], lws["kind"]) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet")
    assert set(lws["spec"]) <= LWS_SPEC
    group = lws["spec"]["leaderWorkerTemplate"]
    assert set(group) <= LWS_TEMPLATE
    assert group["restartPolicy"] in LWS_RESTART
    size = group["size"]
    assert isinstance(size, int) and size >= 2
    leader_t, worker_t = group["leaderTemplate"], group["workerTemplate"]
    for template in (leader_t, worker_t):
        _validate(_pod_template(template))
    (leader,) = leader_t["spec"]["containers"]
    (worker,) = worker_t["spec"]["containers"]
    assert leader["args"] == worker["args"], "one command for every pod of the group"
    # What each pod's `minisgl serve` makes of that command with the variables LWS gives it.
    env = {"LWS_LEADER_ADDRESS": "minisgl-0.minisgl.default", "LWS_GROUP_SIZE": str(size)}
    pods = [_serve_args(leader["args"], env | {"LWS_WORKER_INDEX": str(i)}) for i in range(size)]
    assert [(a.nnodes, a.node_rank) for a in pods] == [(size, i) for i in range(size)]
    assert {a.dist_init_addr for a in pods} == {"minisgl-0.minisgl.default:29500"}
    rendezvous = [p for p in leader["ports"] if p["name"] == "rendezvous"]
    assert [p["containerPort"] for p in rendezvous] == [29500]
    args = pods[0]
    _check_probes(leader, args)
    _check_grace(leader_t["spec"], leader, args)
    assert "readinessProbe" not in worker and "ports" not in worker  # a worker serves no HTTP
    # The worker's SIGTERM comes after the leader's drain, within the worker's grace period.
    leader_drain = _pre_stop_s(leader) + args.shutdown_timeout
    assert leader_drain < _pre_stop_s(worker) < worker_t["spec"]["terminationGracePeriodSeconds"]
    gpus = {c["resources"]["limits"]["nvidia.com/gpu"] for c in (leader, worker)}
    assert gpus == {args.dp * args.tp // size}, "one GPU per rank"
    assert service["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": "minisgl", "role": "leader"}
    assert leader_t["metadata"]["labels"]["role"] == "leader"


def test_the_schema_check_catches_a_typo() -> None:
    deployment, _ = _documents(KUBE / "minisgl.yaml")
    broken = json.loads(json.dumps(deployment))
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(broken)


def _dockerfile(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) per instruction: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile(name: str) -> None:
    steps = _dockerfile(ROOT / "docker" / name)
    words = [w for w, _ in steps]
    assert words.count("FROM") >= 2, "multi-stage"
    final = steps[len(steps) - 1 - words[::-1].index("FROM") :]
    last = {w: rest for w, rest in final}
    assert last["USER"] not in ("root", "0")
    assert last["VOLUME"] == "/cache" and "MINISGL_CACHE_DIR=/cache" in last["ENV"]
    assert last["STOPSIGNAL"] == "SIGTERM"
    entry, cmd = json.loads(last["ENTRYPOINT"]), json.loads(last["CMD"])
    assert entry[-1] == "minisgl"
    args = _serve_args(cmd)
    assert args.host == "0.0.0.0"
    assert f"http://127.0.0.1:{args.port}/health" in last["HEALTHCHECK"]
    # docker stop's grace holds the drain and then the processes' own stop (2-5 s on a busy 2-core box)
    assert args.shutdown_timeout <= DOCKER_STOP_GRACE_S / 2
    copied = [rest for w, rest in final if w == "COPY"]
    assert any(rest.startswith("--from=build /opt/minisgl") for rest in copied)


def test_systemd_unit() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(ROOT / "deploy" / "systemd" / "minisgl.service")
    service = unit["Service"]
    binary, *argv = shlex.split(service["ExecStart"])
    assert binary.endswith("/bin/minisgl")
    args = _serve_args(argv)
    assert float(service["TimeoutStopSec"]) > args.shutdown_timeout + 2
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    assert "MINISGL_CACHE_DIR=/var/cache/minisgl" in service["Environment"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"
