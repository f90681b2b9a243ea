"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Idle OpenMP threads sleep at once instead of spinning first (libgomp reads this when torch loads
# it, so before `import torch`; the servers the tests start inherit it): with the tests spread over
# two pytest-xdist workers (`make test`), a spinning thread takes a core another process needs.
# Only how threads wait changes, not what they compute.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# The tests live in folders mirroring the package map (tests/engine/, tests/entrypoints/, ...) and
# import each other's helpers by module name (test_models_support, test_server, ...): every folder
# goes on sys.path, as the flat tests/ directory was. `TEST_DIRS` is the same list for the tests
# that start Python subprocesses importing those helpers.
TESTS = Path(__file__).resolve().parent
TEST_DIRS = [str(TESTS)] + sorted(
    str(d) for d in TESTS.iterdir() if d.is_dir() and not d.name.startswith((".", "_"))
)
for _d in TEST_DIRS:
    if _d not in sys.path:
        sys.path.append(_d)
os.environ["MINISGL_TEST_DIRS"] = os.pathsep.join(TEST_DIRS)

# Without a GPU, minisgl's Triton kernels run in Triton's CPU interpreter (small shapes, slowly), so
# the suite checks their logic everywhere. Set before any test module imports a kernel: the choice
# is made when a kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# What the fuzz tests sent (name -> count), printed at the end of the run for the note.
FUZZ_COUNTS: dict[str, int] = {}


@pytest.fixture
def fuzz_report():
    """`fuzz_report(name, count)` records how many inputs a fuzz test sent."""

    def record(name: str, count: int) -> None:
        FUZZ_COUNTS[name] = FUZZ_COUNTS.get(name, 0) + count

    return record


# Logs of test servers kept because a test of the module that started them failed.
KEPT_LOGS: list[Path] = []
_MODULE_FAILED = pytest.StashKey[bool]()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Under pytest-xdist (`make test`), a worker hands what it recorded to the controller, which
    prints it (`pytest_testnodedown`)."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["fuzz_counts"] = dict(FUZZ_COUNTS)
        out["kept_logs"] = [str(p) for p in KEPT_LOGS]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's controller: a worker is done; its fuzz counts and kept logs join ours."""
    out = getattr(node, "workeroutput", None) or {}
    for name, count in out.get("fuzz_counts", {}).items():
        FUZZ_COUNTS[name] = FUZZ_COUNTS.get(name, 0) + count
    KEPT_LOGS.extend(Path(p) for p in out.get("kept_logs", []))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FUZZ_COUNTS:
        terminalreporter.section("fuzz counts")
        for name, count in FUZZ_COUNTS.items():
            terminalreporter.write_line(f"{count:>8,}  {name}")
    if KEPT_LOGS:
        terminalreporter.section("logs of the test servers of failed modules")
        for path in KEPT_LOGS:
            terminalreporter.write_line(str(path))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[pytest.TestReport]:
    report = yield
    module = item.getparent(pytest.Module)
    if report.failed and module is not None:
        module.stash[_MODULE_FAILED] = True
    return report


@pytest.fixture(scope="module", autouse=True)
def _server_files(request: pytest.FixtureRequest) -> Iterator[None]:
    """Once a module is over (its server fixtures stopped), removes the ipc roots and logs of the
    servers it started (tests/system/test_server.py's `SERVER_FILES`); the logs stay when a test failed."""
    files = _registry()
    first = len(files)
    yield
    made, files[first:] = files[first:], []
    failed = request.node.stash.get(_MODULE_FAILED, False)
    for root, log in made:
        shutil.rmtree(root, ignore_errors=True)
        if failed and log.exists():
            KEPT_LOGS.append(log)
        else:
            log.unlink(missing_ok=True)


def _registry() -> list[tuple[Path, Path]]:
    # Read through sys.modules: a module that starts servers imports test_server before its tests
    # run, and one that does not needs nothing removed.
    module = sys.modules.get("test_server")
    return module.SERVER_FILES if module is not None else []


@pytest.fixture
def ipc_dir() -> Iterator[Path]:
    """A short directory under /tmp for ipc:// socket paths (sun_path holds only 104-108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="msgl-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when no CUDA device is present."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
