"""The `minisgl` command line: help, option checks and early errors (in-process, no server)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl.cli.main import build_parser, main
from minisgl.launch.args import GROUPS, ServerArgs, args_from_namespace, flag_fields


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
    assert ServerArgs().cache_type is None  # unset: the scheduler config's default
    assert args.host == "127.0.0.1" and args.model_name == "smol" and args.url == "http://127.0.0.1:8000"
    assert ServerArgs().model_name == "SmolLM2-135M-Instruct"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "0"], "--port must be in 1..65535"),
        (["serve", "--tp", "0"], "--tp must be >= 1"),
        (["serve", "--num-tokenizer", "-1"], "--num-tokenizer must be >= 0"),
        (["serve", "--frontend-nice", "20"], "--frontend-nice must be in 0..19"),
        (["serve", "--max-seq-len", "0"], "--max-seq-len must be >= 2"),
        (["serve", "--num-pages", "4", "--kv-cache-memory", "1GiB"], "not allowed with argument"),
        (["serve", "--device", "tpu"], "invalid choice"),
        (["serve", "--port", "many"], "invalid int value"),
        (["serve", "--cache-type", "lru"], "--cache-type must be one of radix, naive, got 'lru'"),
        (["serve", "--attention-backend", "flash"], "--attention-backend must be one of auto, torch"),
        (["serve", "--engine", "fake"], "--engine must be one of model, dummy"),
        (["serve", "--dtype", "float64"], "invalid choice"),
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
    assert spawned_children() == []


def test_busy_port_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", "--engine", "dummy", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert spawned_children() == []  # the warm scheduler interpreter (launch/warm.py) was stopped


def spawned_children() -> list[int]:
    """This process's living children started by multiprocessing's spawn method."""
    import psutil

    out = []
    for c in psutil.Process().children():
        try:
            if "spawn_main" in " ".join(c.cmdline()) and c.status() != psutil.STATUS_ZOMBIE:
                out.append(c.pid)
        except psutil.NoSuchProcess:
            pass
    return out


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


def _serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    return capsys.readouterr().out


def _option_helps(text: str) -> dict[str, str]:
    """`--flag` -> its help text (wrapped lines joined) in `minisgl serve --help`."""
    helps: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        m = re.match(r"^  (--[a-z-]+)(?: [A-Z:{][^ ]*)?(?:  +(.*))?$", line)
        if m:
            flag = m.group(1)
            helps[flag] = m.group(2) or ""
        elif flag is not None and line.startswith("    "):
            helps[flag] += " " + line.strip()
        else:
            flag = None
    return {k: re.sub(r"- ", "-", v) for k, v in helps.items()}  # argparse splits at hyphens


def test_serve_help_shows_the_value_each_unset_option_takes(capsys: pytest.CaptureFixture[str]) -> None:
    """What --help calls the default is what the server then uses: read from ServerArgs() and from
    the scheduler configs it derives on a CPU and on a GPU, not from the help's own source."""
    from minisgl.launch.configs import parse_size, scheduler_config

    helps = _option_helps(_serve_help(capsys))
    unset = ServerArgs()
    cpu, gpu = (scheduler_config(unset, Path("m"), device) for device in ("cpu", "cuda"))
    for f in flag_fields():
        text = helps["--" + f.name.replace("_", "-")]
        m = re.search(r"\(default: ([^()]*(?:\([^()]*\)[^()]*)*)\)$", text)
        assert m, f"--{f.name}: no default in {text!r}"
        shown = m.group(1)
        value = getattr(unset, f.name)
        if value is None and f.metadata.get("config"):  # the scheduler decides
            on_cpu, on_gpu = getattr(cpu, f.name), getattr(gpu, f.name)
            if on_cpu != on_gpu:
                assert shown == f"{on_cpu} on the CPU, {on_gpu} on a GPU", (f.name, shown)
                continue
            value = on_cpu
        if f.name == "max_request_bytes":
            assert parse_size(shown, "x") == value
        elif isinstance(value, bool):
            assert shown == ("on" if value else "off"), (f.name, shown)
        elif value is None:
            assert shown and shown != "None", (f.name, shown)
        elif isinstance(value, (int, float)):
            assert type(value)(shown) == value, (f.name, shown, value)
        else:
            assert shown == str(value), (f.name, shown, value)
    assert "(default: 42)" in helps["--seed"] and "EngineOptions" not in str(helps)
    assert "(default: 256 on the CPU, 4096 on a GPU)" in helps["--max-prefill-tokens"]


def test_every_serve_flag_has_help_in_its_group(capsys: pytest.CaptureFixture[str]) -> None:
    text = _serve_help(capsys)
    helps = _option_helps(text)
    assert set(helps) >= {"--" + f.name.replace("_", "-") for f in flag_fields()} | {"--dummy-engine"}
    for flag, help in helps.items():
        assert len(help) > 10, f"{flag} has no help"
    titles = [
        line[:-1] for line in text.splitlines() if line and not line.startswith(" ") and line.endswith(":")
    ]
    assert titles == ["options", *GROUPS]
    sections = re.split(r"^(\S[^\n]*):$", text, flags=re.M)
    by_group = dict(zip(sections[1::2], sections[2::2], strict=True))
    for flag, group in [
        ("--seed", "engine"),
        ("--cache-type", "scheduler"),
        ("--port", "server (HTTP)"),
        ("--nnodes", "several machines"),
        ("--log-level", "logging"),
        ("--model", "model"),
    ]:
        assert f"  {flag} " in by_group[group], (flag, group)  # fmt: skip


def test_building_the_parser_imports_no_torch() -> None:
    code = (
        "import sys; from minisgl.cli.main import build_parser; build_parser(); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch asks torch for a GPU")
def test_the_launcher_builds_its_configs_without_torch() -> None:
    """`minisgl serve`'s own process (the API server) validates the options, resolves the model (the
    embedded one), builds every rank's SchedulerConfig, pickles it for the spawned scheduler and names
    its target, all without torch."""
    code = (
        "import pickle, sys\n"
        "from minisgl.launch import configs, launcher\n"
        "from minisgl.launch.args import ServerArgs\n"
        "from minisgl.engine.options import resolve_device\n"
        "from minisgl.scheduler import run_scheduler\n"
        "from minisgl.models import resolve_model_path\n"
        "args = ServerArgs(dtype='bfloat16'); args.check()\n"
        "model_dir = resolve_model_path(None, require_weights=True)\n"
        "(config,) = configs.build(args, model_dir, resolve_device(args.device))\n"
        "pickle.dumps((run_scheduler, config))\n"
        "print(config.device, config.dtype, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["cpu", "bfloat16", "False"], out.stderr


def test_a_config_holds_its_dtype_by_name() -> None:
    from minisgl.engine.options import EngineOptions

    assert EngineOptions(dtype=torch.bfloat16).dtype == "bfloat16" == EngineOptions(dtype="bfloat16").dtype
    assert EngineOptions(dtype=torch.float16).torch_dtype is torch.float16
    for bad in (torch.int32, "fp32", 32):
        with pytest.raises(TypeError, match="dtype must be a torch.dtype or one of"):
            EngineOptions(dtype=bad)  # type: ignore[arg-type]


def test_dtype_choices_are_the_engines() -> None:
    from minisgl.engine.options import DTYPES

    (dtype,) = [f for f in flag_fields() if f.name == "dtype"]
    assert dtype.metadata["choices"] == ("auto", *DTYPES)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    import minisgl

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert (
        capsys.readouterr().out.strip() == f"minisgl {minisgl.__version__}" == f"minisgl {version('minisgl')}"
    )


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch")
def test_cuda_on_a_cpu_build_of_torch_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--device", "cuda", "--engine", "dummy"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--device 'cuda': this torch" in err and "is a CPU build" in err, err
    assert "make TORCH=torch setup" in err
    from minisgl.engine.options import resolve_device

    with pytest.raises(ValueError, match="make TORCH=torch setup"):  # LLM(device="cuda") too
        resolve_device("cuda")


@pytest.mark.parametrize(
    "argv", [["chat", "--help"], ["bench", "serve", "--help"], ["bench", "offline", "--help"]]
)
def test_every_flag_of_the_other_commands_has_help(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    helps = _option_helps(capsys.readouterr().out)
    assert len(helps) >= 8
    assert [flag for flag, help in helps.items() if len(help) < 4] == []
