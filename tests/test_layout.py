"""The package map (README/docs "Architecture"): imports point one way, from the packages of a row
to those of the rows above it, with no cycles between modules, and no package grows past about
2,000 lines. Read from the source (no imports), so a violation names the file and line.

Imports under `if TYPE_CHECKING:` are for annotations only (no arrow at run time) and are left out."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "minisgl"

# The rows of the map, lowest first: a package may import the packages of earlier rows and itself.
ROWS: list[tuple[str, ...]] = [
    ("core",),
    ("message",),
    ("utils",),
    ("grammar",),
    ("distributed",),
    ("quant",),
    ("kernels",),
    ("backends",),
    ("kvcache",),
    ("attention",),
    ("layers",),
    ("checkpoint",),
    ("models",),
    ("engine",),
    ("scheduler",),
    ("tokenizer",),
    ("frontend",),
    ("entrypoints",),
    ("launch",),
    ("llm",),
    ("benchmark",),
    ("cli",),
    ("__init__", "__main__"),  # the package's facade and `python -m minisgl`
]
ROW = {pkg: i for i, row in enumerate(ROWS) for pkg in row}
MAX_PACKAGE_LINES = 2_100  # "about 2,000"


def _package(path: Path) -> str:
    return path.relative_to(SRC).parts[0].removesuffix(".py")


def _module(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = ("minisgl", *rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _facade() -> dict[str, str]:
    """What `from minisgl import X` really imports: the module the facade takes X from."""
    out = {}
    for node in ast.parse((SRC / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minisgl."):
            out.update({a.asname or a.name: node.module for a in node.names})
    return out


def _imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, module imported, at the module's top level) for each minisgl import outside TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    top = {id(n) for n in tree.body}
    facade, here = _facade(), _module(path)
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here.split(".") if path.name == "__init__.py" else here.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                names = [".".join([*base, node.module] if node.module else base)]
            elif node.module == "minisgl":
                names = [facade.get(a.name, "minisgl") for a in node.names]
            elif node.module and node.module.startswith("minisgl."):
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("minisgl.")]
        out += [(node.lineno, n, id(node) in top) for n in names]
    return out


FILES = sorted(SRC.rglob("*.py"))


def test_every_package_has_a_row() -> None:
    missing = sorted({_package(f) for f in FILES} - set(ROW))
    assert not missing, f"packages missing from the map: {missing}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_up_the_map(path: Path) -> None:
    pkg = _package(path)
    wrong = [
        f"{path.relative_to(SRC)}:{line} imports {mod}"
        for line, mod, _ in _imports(path)
        if mod.count(".") >= 1
        and (target := mod.split(".")[1]) != pkg
        and ROW.get(target, len(ROWS)) >= ROW[pkg]
    ]
    assert not wrong, (
        "an import against the package map (move the piece, don't add the arrow):\n" + "\n".join(wrong)
    )


def test_no_import_cycles_between_modules() -> None:
    """At import time (top-level imports): a cycle makes the import order matter."""
    modules = {_module(f): f for f in FILES}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for _, mod, top in _imports(path):
            while mod not in modules and "." in mod:  # `from pkg.mod import name` of a name, not a module
                mod = mod.rpartition(".")[0]
            if top and mod != name and mod in modules and not name.startswith(mod + "."):
                graph[name].add(mod)
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*stack, node])):
                return cycle
        state[node] = 2
        return None

    for m in sorted(modules):
        if m not in state and (cycle := visit(m, [])):
            pytest.fail("import cycle: " + " -> ".join(cycle[cycle.index(cycle[-1]) :]))


def test_no_package_is_too_large() -> None:
    sizes: dict[str, int] = defaultdict(int)
    for f in FILES:
        sizes[str(f.parent.relative_to(SRC))] += len(f.read_text().splitlines())
    large = {d: n for d, n in sizes.items() if d != "." and n > MAX_PACKAGE_LINES}
    assert not large, f"packages over {MAX_PACKAGE_LINES} lines (split them by concept): {large}"
