"""The documentation: the site builds strictly (no broken link, no page left out), the README's
links resolve, and every code block of README.md and docs/*.md marked runnable runs as written.

A runnable block is a fenced `bash` or `python` block right after a `<!-- run -->` line
(`<!-- run: slow -->`: the same, run by `make test-slow` only). The bash blocks run against one real
server of the embedded model (what `make serve` serves), its free port in place of 1919, with this
interpreter's bin directory first on the PATH (where `minisgl` is); the python blocks run as scripts
in a fresh interpreter. A block shown twice (the README's offline example is the offline page's)
runs once. Each must exit 0. When a `json` block follows (the answer the docs show), every field of
that answer must be in the server's own answer."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_server import ServerProcess

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKERS = {"<!-- run -->": False, "<!-- run: slow -->": True}  # -> slow
_FENCE = re.compile(r"^```(\w*)\s*$")
_PORT = re.compile(r"\b(localhost|127\.0\.0\.1):1919\b")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    answer: str | None = None  # the `json` block after it, if any
    slow: bool = False

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _fenced(lines: list[str], start: int) -> tuple[str, str, int]:
    """(info string, body, index after the closing fence) of the fence opening at lines[start]."""
    m = _FENCE.match(lines[start])
    if m is None:
        raise ValueError(f"line {start + 1}: expected a code fence, got {lines[start]!r}")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return m.group(1), "\n".join(lines[start + 1 : end]) + "\n", end + 1


def runnable_blocks(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() not in MARKERS:
            continue
        lang, code, after = _fenced(lines, i + 1)
        while after < len(lines) and not lines[after].strip():
            after += 1
        answer = None
        if after < len(lines) and lines[after].startswith("```json"):
            answer = _fenced(lines, after)[1]
        blocks.append(Block(page, i + 2, lang, code, answer, MARKERS[line.strip()]))
    return blocks


def _unique(blocks: list[Block]) -> list[Block]:
    """The blocks, each code once (its first place)."""
    first: dict[tuple[str, str], Block] = {}
    for b in blocks:
        first.setdefault((b.lang, b.code), b)
    return list(first.values())


BLOCKS = _unique([b for page in PAGES for b in runnable_blocks(page)])


def test_the_runnable_blocks_are_found() -> None:
    """Every marker marks a bash or python block; the README's quickstart and each page with
    examples have theirs."""
    assert {b.lang for b in BLOCKS} == {"bash", "python"}
    pages = {b.page.name for b in BLOCKS}
    assert {"README.md", "openai-api.md", "offline.md", "prefix-caching.md", "deployment.md"} <= pages
    assert sum(b.page.name == "openai-api.md" and b.answer is not None for b in BLOCKS) >= 12


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "openai-api" / "index.html").is_file()


def test_the_readme_links_resolve() -> None:
    """The README is not part of the site: its links to files and to headings are checked here."""
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]*))?\)", (ROOT / "README.md").read_text())
    local = [(path, anchor) for path, anchor in links if "://" not in path]
    assert ("docs/openai-api.md", "") in local and ("LICENSE", "") in local
    assert [path for path, _ in local if not (ROOT / path).exists()] == []
    for path, anchor in local:
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{path}#{anchor}"


def _slug(heading: str) -> str:
    """A heading's anchor as mkdocs' toc writes it."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def test_the_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 160


@pytest.fixture(scope="module")
def docs_server() -> Iterator[ServerProcess]:
    srv = ServerProcess()  # no options: `make serve`'s server
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "block", [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if b.slow else []) for b in BLOCKS]
)
def test_a_runnable_block_runs_as_written(
    block: Block, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    code = block.code
    if block.lang == "bash" or _PORT.search(code):  # it talks to the server (started once, when first needed)
        port = request.getfixturevalue("docs_server").port
        code = _PORT.sub(lambda m: f"{m.group(1)}:{port}", code)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if block.lang == "bash":
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    else:
        script = tmp_path / "block.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, f"{block.name} exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
    assert out.stdout.strip(), f"{block.name} printed nothing"
    if block.answer is not None:
        shown, got = json.loads(block.answer), json.loads(out.stdout)
        assert ("error" in shown) == ("error" in got), f"{block.name}: {out.stdout}"
        missing = _fields(shown) - _fields(got)
        assert not missing, f"{block.name}: the answer shown has fields the server's lacks: {missing}"
    elif _is_error(out.stdout):
        raise AssertionError(f"{block.name} got an error: {out.stdout}")


def _fields(value: object, at: tuple[object, ...] = ()) -> set[tuple[object, ...]]:
    """The paths of an answer's fields: objects' keys (not of maps keyed by token text) and the
    fields of the first item of each list."""
    if isinstance(value, dict) and all(re.fullmatch(r"[a-z_][a-z0-9_]*", k) for k in value):
        return {at + (k,) for k in value} | {p for k, v in value.items() for p in _fields(v, at + (k,))}
    if isinstance(value, list) and value:
        return _fields(value[0], at + (0,))
    return set()


def _is_error(text: str) -> bool:
    try:
        body = json.loads(text)
    except ValueError:
        return False
    return isinstance(body, dict) and "error" in body


def test_fields_of_an_answer() -> None:
    shown = {"choices": [{"text": "a", "logprobs": {"top_logprobs": [{" Paris": -1.0}]}}], "usage": {}}
    assert _fields(shown) == {
        ("choices",),
        ("choices", 0, "text"),
        ("choices", 0, "logprobs"),
        ("choices", 0, "logprobs", "top_logprobs"),
        ("usage",),
    }
    assert _fields({"a": []}) - _fields({"a": [], "b": 1}) == set()
    assert _fields({"a": [{"x": 1}]}) - _fields({"a": []}) == {("a", 0, "x")}
