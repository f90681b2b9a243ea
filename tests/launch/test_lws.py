"""`minisgl serve` on LeaderWorkerSet: LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX stand
in for --dist-init-addr, --nnodes and --node-rank; a flag given wins; a partial set is refused."""

from __future__ import annotations

import pytest

from minisgl.cli.main import build_parser, main
from minisgl.launch.args import ServerArgs, args_from_namespace
from minisgl.launch.lws import DEFAULT_PORT, leader_addr

LEADER = "minisgl-0.minisgl.default"


def _args(argv: list[str], env: dict[str, str]) -> ServerArgs:
    return args_from_namespace(build_parser().parse_args(["serve", "--engine", "dummy", *argv]), env)


def _lws(index: int, size: int = 2) -> dict[str, str]:
    return {"LWS_LEADER_ADDRESS": LEADER, "LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index)}


def test_without_lws_the_defaults_hold() -> None:
    args = _args([], {"HOME": "/root"})
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (1, 0, None)


@pytest.mark.parametrize("index", [0, 1])
def test_every_pod_of_a_group_runs_the_same_command(index: int) -> None:
    args = _args(["--tp", "2"], _lws(index))
    assert (args.nnodes, args.node_rank) == (2, index)
    assert args.dist_init_addr == f"{LEADER}:{DEFAULT_PORT}"


def test_flags_given_win_over_the_variables() -> None:
    argv = ["--tp", "4", "--nnodes", "4", "--node-rank", "3", "--dist-init-addr", "10.0.0.1:4000"]
    args = _args(argv, _lws(1))
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (4, 3, "10.0.0.1:4000")
    args = _args(["--tp", "2", "--dist-init-addr", "10.0.0.1:4000"], _lws(1))  # the others from LWS
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (2, 1, "10.0.0.1:4000")


def test_a_partial_set_is_refused_naming_what_is_missing() -> None:
    with pytest.raises(ValueError, match=r"LWS_GROUP_SIZE set, LWS_LEADER_ADDRESS, LWS_WORKER_INDEX not"):
        _args(["--tp", "2"], {"LWS_GROUP_SIZE": "2"})
    # what is missing given as flags: fine
    args = _args(["--tp", "2", "--node-rank", "1", "--dist-init-addr", "h:1"], {"LWS_GROUP_SIZE": "2"})
    assert (args.nnodes, args.node_rank, args.dist_init_addr) == (2, 1, "h:1")


@pytest.mark.parametrize("value", ["two", "-1", "1.5"])
def test_a_malformed_variable_is_named(value: str) -> None:
    with pytest.raises(ValueError, match=rf"LWS_GROUP_SIZE must be a whole number >= 0, got '{value}'"):
        _args(["--tp", "2"], {**_lws(0), "LWS_GROUP_SIZE": value})


def test_the_checks_of_the_flags_apply_to_what_lws_gave() -> None:
    with pytest.raises(ValueError, match=r"--node-rank must be in 0..1, got 2"):
        _args(["--tp", "2"], _lws(2))
    with pytest.raises(ValueError, match=r"must divide evenly over --nnodes 2"):
        _args([], _lws(0))  # one rank over two pods


def test_the_command_line_reports_a_partial_set(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    monkeypatch.delenv("LWS_LEADER_ADDRESS", raising=False)
    monkeypatch.delenv("LWS_GROUP_SIZE", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--tp", "2"])
    assert e.value.code == 2
    assert "LeaderWorkerSet's variables are set only in part" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("leader", "addr"),
    [
        ("minisgl-0.minisgl.ns", "minisgl-0.minisgl.ns:29500"),
        ("10.1.2.3", "10.1.2.3:29500"),
        ("fd00::1", "[fd00::1]:29500"),
        ("leader:4000", "leader:4000"),
        ("[fd00::1]:4000", "[fd00::1]:4000"),
    ],
)
def test_leader_address(leader: str, addr: str) -> None:
    assert leader_addr(leader) == addr


def test_help_still_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--nnodes N machines the --dp x --tp ranks run on (contiguously, by node rank) (default: 1)" in out
    assert "(default: 0)" in out.rsplit("--node-rank K", 1)[1].split("--dist-init-addr HOST:PORT", 1)[0]
