"""The run's root conftest: the peers' package names stood in for before their test files import them."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import huggingface_hub
import peer_stubs

peer_stubs.install_vllm()
peer_stubs.install_sglang()


def _no_download(*args: Any, **kwargs: Any) -> str:
    """vLLM's test_chat.py downloads a LoRA adapter for its server fixture before the base-model tests
    can start; nothing is downloaded here (no network, and the LoRA tests are out of scope), an
    empty folder stands in and the server's --lora-modules flag is left out."""
    return tempfile.mkdtemp(prefix="lora-stand-in-")


huggingface_hub.snapshot_download = _no_download


# -- results for run.py: node id -> outcome and the failure's last line --------------------------

RESULTS: dict[str, dict[str, str]] = {}


def pytest_runtest_logreport(report: Any) -> None:
    entry = RESULTS.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if report.when == "call" and not report.passed:
        entry["outcome"] = "skipped" if report.skipped else "failed"
    elif report.failed and entry["outcome"] == "passed":
        entry["outcome"] = "error"  # in setup (e.g. the server did not start) or teardown
    elif report.skipped and report.when == "setup":
        entry["outcome"] = "skipped"
    if report.when == "teardown":  # written as the run goes: a run cut short keeps what it saw
        _write_results()
    if report.failed and not entry["message"]:
        text = str(report.longrepr).strip().splitlines()
        errors = [line for line in text if line.startswith("E ")]
        entry["message"] = " | ".join(e[1:].strip() for e in errors[:3]) if errors else (text or [""])[-1]


def _write_results() -> None:
    Path("results.json").write_text(json.dumps(RESULTS, indent=1))


def pytest_sessionfinish(session: Any) -> None:
    _write_results()
