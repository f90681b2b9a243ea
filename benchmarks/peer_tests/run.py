"""Runs vLLM's and SGLang's own OpenAI-server tests against `minisgl serve`, with only their harness
swapped, and prints passed / failed / errored per test file and the total.

    python benchmarks/peer_tests/run.py PEERS_DIR [--only SUBSTRING] [--work DIR] [pytest args]
    python benchmarks/peer_tests/run.py --list            # the selection, without running
    python benchmarks/peer_tests/run.py --fetch-commands  # how to get the measured versions

PEERS_DIR holds the peers' files at their repository paths: PEERS_DIR/vllm/tests/... and
PEERS_DIR/sglang/test/... (a checkout of each repository, or only the files selection.py names).
Nothing of theirs is kept in this repository. The files are copied into a work folder with the
harness (harness/): a stand-in for vLLM's tests/utils.py (RemoteOpenAIServer), stand-ins for the
names their tests import from `vllm` and `sglang` (peer_stubs.py), and a wrapper that starts
`minisgl serve` with the embedded model under the model name each test asks for
(minisgl_peer_server.py). The counted tests and the model-specific ones are run (under nice);
the out-of-scope ones are listed with their reasons."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from selection import FILES, SUPPORT_FILES, PeerFile  # noqa: E402

HARNESS = Path(__file__).resolve().parent / "harness"
PYTEST_INI = """[pytest]
asyncio_mode = strict
asyncio_default_fixture_loop_scope = function
pythonpath = harness
timeout = 1200
addopts = -p no:cacheprovider
"""
Results = dict[str, dict[str, str]]


def copy_peer_file(peers: Path, work: Path, repo: str, path: str) -> None:
    src, dst = peers / repo / path, work / repo / path
    if not src.is_file():
        raise SystemExit(f"missing {src} (--fetch-commands prints how to get it)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)


def make_vllm_tests_a_package(work: Path) -> None:
    """vLLM's tests import `tests.utils` (basic/conftest.py as `....utils`): tests/ is a package,
    and its utils.py is our stand-in."""
    tests = work / "vllm" / "tests"
    for folder in [tests, *(p for p in tests.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    shutil.copyfile(HARNESS / "vllm_utils.py", tests / "utils.py")


def build_work(peers: Path, work: Path, files: list[PeerFile]) -> None:
    if work.exists():
        shutil.rmtree(work)
    (work / "harness").mkdir(parents=True)
    for name in ("minisgl_peer_server.py", "peer_stubs.py"):
        shutil.copyfile(HARNESS / name, work / "harness" / name)
    shutil.copyfile(HARNESS / "conftest.py", work / "conftest.py")
    (work / "pytest.ini").write_text(PYTEST_INI)
    for repo, path, _ in SUPPORT_FILES:
        copy_peer_file(peers, work, repo, path)
    for f in files:
        copy_peer_file(peers, work, f.repo, f.path)
    make_vllm_tests_a_package(work)


def node_id(f: PeerFile, name: str) -> str:
    return f"{f.repo}/{f.path}::{name}"


def run_pytest(work: Path, files: list[PeerFile], extra: list[str], counted_only: bool) -> None:
    ids = [node_id(f, n) for f in files for n in (*f.counted, *(() if counted_only else f.model_specific))]
    cmd = ["nice", "-n", "19", sys.executable, "-m", "pytest", "-q", "-rfE", *extra, *ids]
    env = {**os.environ, "PEER_TESTS_LOG_DIR": str(work / "logs"), "HF_HUB_OFFLINE": "1"}
    subprocess.call(cmd, cwd=work, env=env)


def read_results(work: Path) -> Results:
    """node id -> {"outcome": passed / failed / error / skipped, "message": the failure's last line},
    as the harness's conftest wrote them."""
    path = work / "results.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def outcome(results: Results, f: PeerFile, name: str) -> str:
    return results.get(node_id(f, name), {}).get("outcome", "missing")


def message(results: Results, f: PeerFile, name: str) -> str:
    return results.get(node_id(f, name), {}).get("message", "not collected")


def print_counted(files: list[PeerFile], results: Results) -> Counter[str]:
    total: Counter[str] = Counter()
    print("\n== counted tests, per file ==")
    for f in files:
        counts = Counter(outcome(results, f, name) for name in f.counted)
        total.update(counts)
        print(f"{f.repo}/{f.path}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    print("\n== counted tests that did not pass ==")
    for f in files:
        for name in f.counted:
            if outcome(results, f, name) != "passed":
                print(f"  {outcome(results, f, name)}: {node_id(f, name)}\n      {message(results, f, name)}")
    return total


def print_model_specific(files: list[PeerFile], results: Results) -> None:
    print("\n== run, not counted: assertions on a particular model's words or token counts ==")
    for f in files:
        for name, why in f.model_specific.items():
            print(f"  {outcome(results, f, name)}: {node_id(f, name)}\n      asserts: {why}")
            if outcome(results, f, name) != "passed":
                print(f"      failure: {message(results, f, name)}")


def print_out_of_scope(files: list[PeerFile]) -> None:
    print("\n== out of scope (not run) ==")
    for f in files:
        for name, why in f.out_of_scope.items():
            print(f"  {node_id(f, name)}: {why}")


def print_selection(files: list[PeerFile]) -> None:
    for f in files:
        print(
            f"{f.repo}/{f.path} @ {f.commit[:12]}: {len(f.counted)} counted, "
            f"{len(f.model_specific)} model-specific, {len(f.out_of_scope)} out-of-scope entries"
        )
    print(f"counted: {sum(len(f.counted) for f in files)}")
    print_out_of_scope(files)


def print_fetch_commands() -> None:
    print(
        "# run in PEERS_DIR, with clones of the repositories at PEERS_DIR/vllm-src and PEERS_DIR/sglang-src"
    )
    for repo, path, commit in [*SUPPORT_FILES, *((f.repo, f.path, f.commit) for f in FILES)]:
        print(
            f"mkdir -p {repo}/{Path(path).parent} && git -C {repo}-src show {commit}:{path} > {repo}/{path}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("peers", nargs="?", type=Path, help="the folder with the peers' test files")
    ap.add_argument("--only", default="", help="only the files whose path contains this")
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "minisgl-peer-tests")
    ap.add_argument("--list", action="store_true", help="print the selection and exit")
    ap.add_argument(
        "--counted-only",
        action="store_true",
        help="skip the model-specific tests (some generate until the context is full)",
    )
    ap.add_argument("--fetch-commands", action="store_true", help="print how to get the measured files")
    ap.add_argument("--report-only", action="store_true", help="print the report of the last run in --work")
    args, extra = ap.parse_known_args()
    files = [f for f in FILES if args.only in f"{f.repo}/{f.path}"]
    if args.fetch_commands:
        return print_fetch_commands()
    if args.list or args.peers is None:
        return print_selection(files)
    work = args.work.resolve()
    if not args.report_only:
        build_work(args.peers.resolve(), work, files)
        run_pytest(work, files, extra, args.counted_only)
    results = read_results(work)
    total = print_counted(files, results)
    print_model_specific(files, results)
    print_out_of_scope(files)
    errored = total["error"] + total["skipped"]
    missing = f", {total['missing']} not run" if total["missing"] else ""
    print(
        f"\npeer tests: {total['passed']} passed, {total['failed']} failed, {errored} errored{missing} "
        f"of {sum(total.values())} counted (server logs: {work / 'logs'})"
    )


if __name__ == "__main__":
    main()
