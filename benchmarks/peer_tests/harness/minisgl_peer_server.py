"""`minisgl serve` with the embedded model, started the way the peers' harnesses start their own
servers: under the model name the test gives (so the test's `model=` is the served name), with the
peer's own flags translated where minisgl has the same setting and the rest recorded as ignored.

Used by the vLLM stand-in (`tests/utils.py`'s RemoteOpenAIServer) and the SGLang stand-in
(`sglang.test.test_utils.popen_launch_server`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import httpx

# peer flag -> minisgl flag, for settings both servers have (each takes one value).
_SAME_SETTING = {
    "--max-model-len": "--max-seq-len",  # vLLM
    "--context-length": "--max-seq-len",  # SGLang
    "--max-num-seqs": "--max-running-requests",  # vLLM
    "--max-running-requests": "--max-running-requests",  # SGLang
    "--seed": "--seed",
}
# peer flags without a value that map to a minisgl flag with one.
_SAME_SWITCH = {"--no-enable-prefix-caching": ("--cache-type", "naive")}
# tool-call formats minisgl parses under the same name.
_TOOL_PARSERS = {"hermes", "llama3_json"}
_STARTUP_TIMEOUT_S = 300.0
# One CPU thread per server unless the caller chose: the tests share the machine with the client and
# whatever else runs there, and under such load OpenMP barriers between preempted threads made
# decoding over ten times slower than one thread (measured here: 48 tokens in 6-10 s vs 117-176 s).
# A speed setting only; nothing a request sees depends on it.
_SERVER_ENV = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
LOG_DIR = Path(os.environ.get("PEER_TESTS_LOG_DIR", "peer-logs"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _flag_value(args: list[str], i: int) -> tuple[str, str | None, int]:
    """(flag, its value or None, index of the next argument) for `--flag value` or `--flag=value`."""
    arg = args[i]
    if "=" in arg:
        flag, value = arg.split("=", 1)
        return flag, value, i + 1
    takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
    return arg, args[i + 1] if takes_value else None, i + (2 if takes_value else 1)


def translate_args(peer_args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(minisgl's flags, the peer flags that have no minisgl counterpart and are left out)."""
    args, ignored, out, i = [str(a) for a in peer_args], [], [], 0
    while i < len(args):
        flag, value, i = _flag_value(args, i)
        if flag in _SAME_SETTING and value is not None:
            out += [_SAME_SETTING[flag], value]
        elif flag in _SAME_SWITCH:
            out += list(_SAME_SWITCH[flag])
        elif flag == "--tool-call-parser" and value in _TOOL_PARSERS:
            out += [flag, str(value)]
        else:
            ignored.append(flag if value is None else f"{flag} {value}")
    return out, ignored


class MinisglServer:
    """One `python -m minisgl serve` on 127.0.0.1:`port`, healthy when the constructor returns."""

    def __init__(self, model_name: str, peer_args: Sequence[str] = (), port: int | None = None) -> None:
        self.model_name = model_name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags, self.ignored = translate_args(peer_args)
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        self.log_path = LOG_DIR / f"server-{self.port}-{int(time.time() * 1000)}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        cmd = [sys.executable, "-m", "minisgl", "serve", "--port", str(self.port)]
        cmd += ["--served-model-name", model_name, *flags]
        self._log.write(f"# {' '.join(cmd)}\n# peer flags left out: {self.ignored}\n".encode())
        self._log.flush()
        env = {**os.environ, **_SERVER_ENV}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"minisgl serve exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"minisgl serve not healthy after {_STARTUP_TIMEOUT_S} s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# -- what the peers' tests learn about the served model through their own packages ---------------


@cache
def served_model_dir() -> Path:
    """The Hugging Face directory minisgl derives from the embedded GGUF (config.json, tokenizer)."""
    from minisgl.models.resolve import resolve_model_path

    return resolve_model_path(None, progress=False)


@cache
def tokenizer() -> Any:
    """The served model's tokenizer (what the peers' `get_tokenizer` returns for any name)."""
    from minisgl.utils.hf import load_tokenizer

    return load_tokenizer(served_model_dir())


def vocab_size() -> int:
    import json

    return int(json.loads((served_model_dir() / "config.json").read_text())["vocab_size"])
