"""The `minisgl` command line: help, option checks and early errors (in-process, no server)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from minisgl.cli.main import build_parser, main
from minisgl.launch.args import ServerArgs, args_from_namespace


def test_python_dash_m_help_lists_the_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for word in ("serve", "chat", "bench"):
        assert word in out.stdout


@pytest.mark.parametrize("argv", [["serve", "--help"], ["chat", "--help"], ["bench", "serve", "--help"]])
def test_subcommand_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: minisgl") and "--" in out


def test_serve_options_map_to_server_args() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "--port",
            "8000",
            "--tp",
            "2",
            "--num-tokenizer",
            "2",
            "--dummy-engine",
            "--max-seq-len",
            "512",
            "--kv-cache-memory",
            "64MiB",
            "--served-model-name",
            "smol",
            "--max-queued-requests",
            "3",
            "--cache-type",
            "naive",
            "--dummy-step-ms",
            "2.5",
        ]
    )
    args = args_from_namespace(ns)
    assert args == ServerArgs(
        port=8000,
        tp=2,
        num_tokenizer=2,
        engine="dummy",
        max_seq_len=512,
        kv_cache_memory="64MiB",
        served_model_name="smol",
        max_queued_requests=3,
        cache_type="naive",
        dummy_step_ms=2.5,
    )
    assert ServerArgs().cache_type == "radix"
    assert args.host == "127.0.0.1" and args.model_name == "smol" and args.url == "http://127.0.0.1:8000"
    assert ServerArgs().model_name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "0"], "--port must be in 1..65535"),
        (["serve", "--tp", "0"], "--tp must be >= 1"),
        (["serve", "--num-tokenizer", "-1"], "--num-tokenizer must be >= 0"),
        (["serve", "--max-seq-len", "0"], "--max-seq-len must be >= 2"),
        (["serve", "--num-pages", "4", "--kv-cache-memory", "1GiB"], "not allowed with argument"),
        (["serve", "--device", "tpu"], "invalid choice"),
        (["serve", "--port", "many"], "invalid int value"),
        (["serve", "--cache-type", "lru"], "invalid choice"),
        (["serve", "--watchdog-timeout", "-1"], "--watchdog-timeout must be >= 0 (0: off)"),
        (["serve", "--stall-timeout", "nan"], "--stall-timeout must be >= 0 (0: off)"),
        (["serve", "--request-timeout", "0"], "--request-timeout must be > 0"),
        (["serve", "--max-connections", "-2"], "--max-connections must be >= 0 (0: no cap)"),
        (["serve", "--read-timeout", "0"], "--read-timeout must be > 0"),
    ],
)
def test_bad_serve_options_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_model_is_a_clear_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "no such model" in err


def test_busy_port_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", "--engine", "dummy", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_bench_against_nothing_reports_failures(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_json = tmp_path / "r.json"
    code = main(
        [
            "bench",
            "serve",
            "--base-url",
            f"http://127.0.0.1:{port}",
            "--num-prompts",
            "3",
            "--warmup",
            "0",
            "--output-json",
            str(out_json),
        ]
    )
    assert code == 1
    assert "0 ok, 3 failed" in capsys.readouterr().out
    assert out_json.exists()


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: minisgl" in capsys.readouterr().out
