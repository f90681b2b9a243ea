"""Hugging Face model ids (`minisgl.models.hub`), with no network: ids told from paths, the files
chosen from a repo's listing, a hub cache the test writes (blobs, snapshots, refs) used as it is
offline or with the hub unreachable (by resolve_model_path, LLM and `minisgl serve`), and downloads
from a local stand-in for the hub (HF_ENDPOINT, `hub_stand_in.py`): only the needed files, a
transfer cut off midway resumed with a Range request, complete files not fetched again after a failed
run, a gated repo with and without HF_TOKEN, one file of a GGUF repo by :QUANT and by --gguf-file,
and a server started from an id listing it in /v1/models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hub_stand_in import StandInHub, read_dir, write_cache
from test_models_support import save_tiny_hf_model

from minisgl.models import ModelConfigError, resolve_model_path
from minisgl.models.hub import META_FILES, HubOptions, parse_model_id, select_files

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny"), tie=True)


@pytest.fixture(scope="module")
def tiny_files(tiny_dir: Path) -> dict[str, bytes]:
    """The tiny model's files as a repo holds them, with files minisgl does not read."""
    extra = {"README.md": b"# tiny\n", "pytorch_model.bin": b"\0" * 4096, "onnx/model.onnx": b"\1" * 512}
    return read_dir(tiny_dir) | extra


def needed(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if k in META_FILES or k.endswith(".safetensors")}


def test_model_ids_are_told_from_paths(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_model_id("Qwen/Qwen3-0.6B") == ("Qwen/Qwen3-0.6B", None)
    assert parse_model_id("bartowski/SmolLM2-135M-Instruct-GGUF:Q4_K_M") == (
        "bartowski/SmolLM2-135M-Instruct-GGUF",
        "Q4_K_M",
    )
    for not_an_id in ("./org/name", "/abs/org/name", "~/org/name", "name", "a/b/c", "org/na me", "org/"):
        assert parse_model_id(not_an_id) is None, not_an_id
    # A directory that exists is the directory, whatever it looks like.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "tiny").symlink_to(tiny_dir)
    assert resolve_model_path("org/tiny") == Path("org/tiny")
    with pytest.raises(ModelConfigError, match="--gguf-file names a file of a Hugging Face repo"):
        resolve_model_path("org/tiny", hub=HubOptions(gguf_file="x.gguf"))


REPO = [
    "README.md",
    ".gitattributes",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
    "model.safetensors.index.json",
    "consolidated.safetensors",
    "pytorch_model.bin",
    "onnx/model.onnx",
    "modules.json",
    "1_Pooling/config.json",
]
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
META = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "modules.json",
    "1_Pooling/config.json",
]


def test_only_the_files_minisgl_reads_are_chosen() -> None:
    sel = select_files("org/m", REPO, None, None, True, SHARDS)
    assert sorted(sel.files) == sorted([*META, "model.safetensors.index.json", *SHARDS]) and sel.gguf is None
    # without an index: every top-level safetensors file; dummy weights: none
    plain = [f for f in REPO if f not in ("model.safetensors.index.json", "consolidated.safetensors")]
    assert sorted(select_files("org/m", plain, None, None, True).files) == sorted([*META, *SHARDS])
    assert sorted(select_files("org/m", REPO, None, None, False).files) == sorted(META)
    with pytest.raises(ModelConfigError, match="no \\*.safetensors"):
        select_files("org/m", ["config.json", "pytorch_model.bin"], None, None, True)
    with pytest.raises(ModelConfigError, match="no config.json"):
        select_files("org/m", ["model.safetensors"], None, None, True)


GGUF_REPO = [
    "README.md",
    "SmolLM2-135M-Instruct-Q4_K_M.gguf",
    "SmolLM2-135M-Instruct-Q4_K_S.gguf",
    "SmolLM2-135M-Instruct.Q8_0.gguf",
    "big-Q6_K-00001-of-00002.gguf",
    "big-Q6_K-00002-of-00002.gguf",
]


def test_one_gguf_file_is_chosen_by_quant_or_name() -> None:
    sel = select_files("o/g", GGUF_REPO, "q4_k_m", None, True)  # case-insensitive
    assert sel.files == ["SmolLM2-135M-Instruct-Q4_K_M.gguf"] == [sel.gguf]
    assert select_files("o/g", GGUF_REPO, "Q8_0", None, True).gguf == "SmolLM2-135M-Instruct.Q8_0.gguf"
    assert select_files("o/g", GGUF_REPO, None, "big-Q6_K-00001-of-00002.gguf", True).files == [
        "big-Q6_K-00001-of-00002.gguf"
    ]
    with pytest.raises(ModelConfigError, match="no GGUF file for 'Q4_K'.*Q4_K_M, Q4_K_S"):
        select_files("o/g", GGUF_REPO, "Q4_K", None, True)  # a prefix of two names is neither
    with pytest.raises(ModelConfigError, match="split into several files"):
        select_files("o/g", GGUF_REPO, "Q6_K", None, True)
    with pytest.raises(ModelConfigError, match="is a GGUF repo: name one file as o/g:QUANT.*Q8_0"):
        select_files("o/g", GGUF_REPO, None, None, True)
    with pytest.raises(ModelConfigError, match="no file 'nope.gguf'"):
        select_files("o/g", GGUF_REPO, None, "nope.gguf", True)


# -- the cache, offline ------------------------------------------------------------------------------


def test_offline_the_cached_snapshot_is_used_as_it_is(
    tiny_files: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    cache = tmp_path / "hub"
    main = write_cache(cache, "org/tiny", tiny_files)
    v1_files = tiny_files | {
        "config.json": tiny_files["config.json"].replace(
            b'"max_position_embeddings": 256', b'"max_position_embeddings": 128'
        )
    }
    v1 = write_cache(cache, "org/tiny", v1_files, rev="v1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_model_path("org/tiny") == main
    assert resolve_model_path("org/tiny", hub=HubOptions(revision="v1")) == v1
    assert resolve_model_path("org/tiny", hub=HubOptions(revision=v1.name)) == v1  # a commit
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM("org/tiny", device="cpu", num_pages=32) as llm:
        by_id = llm.generate("hello", params)[0]["token_ids"]
    with LLM(str(main), device="cpu", num_pages=32) as llm:
        assert llm.generate("hello", params)[0]["token_ids"] == by_id
    with LLM("org/tiny", revision="v1", device="cpu", num_pages=32) as llm:
        assert llm.max_seq_len == 128


def test_offline_a_missing_model_is_an_error_naming_id_cache_and_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    with pytest.raises(ModelConfigError) as e:
        resolve_model_path("org/absent", hub=HubOptions(download_dir=str(cache)))
    msg = str(e.value)
    assert "org/absent is not in the Hugging Face cache" in msg and str(cache) in msg, msg
    assert "HF_HUB_OFFLINE" in msg and f"`hf download org/absent --cache-dir {cache}`" in msg, msg
    # the same from `minisgl serve`, before anything starts
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisgl",
            "serve",
            "--model",
            "org/absent:Q4_K_M",
            "--download-dir",
            str(cache),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    assert "org/absent is not in the Hugging Face cache" in r.stderr
    assert "hf download org/absent --include '*Q4_K_M*.gguf'" in r.stderr, r.stderr


# -- the stand-in hub ----------------------------------------------------------------------------------


@pytest.fixture
def hub() -> StandInHub:
    with StandInHub() as h:
        yield h


def resolve(
    hub_url: str, cache: Path, model: str, env: dict[str, str] | None = None, **options: str
) -> subprocess.CompletedProcess:
    """resolve_model_path(model) in a fresh process pointed at the stand-in hub (huggingface_hub
    reads HF_ENDPOINT when it is imported); the path on the last line of stdout."""
    script = (
        "import json, sys\n"
        "from huggingface_hub import constants\n"
        # huggingface_hub writes a download in chunks of 10 MiB: smaller ones for the tiny files here
        "constants.DOWNLOAD_CHUNK_SIZE = 16384\n"
        "from minisgl.models import resolve_model_path\n"
        "from minisgl.models.hub import HubOptions\n"
        "print(resolve_model_path(sys.argv[1], hub=HubOptions(**json.loads(sys.argv[2]))))\n"
    )
    full = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_TOKEN")}
    full |= {
        "HF_ENDPOINT": hub_url,
        "HF_HUB_CACHE": str(cache),
        "MINISGL_CACHE_DIR": str(cache.parent / "msgl"),
    }
    return subprocess.run(
        [sys.executable, "-c", script, model, json.dumps(options)],
        env=full | (env or {}),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_download_fetches_only_the_needed_files_and_resumes_a_cut_transfer(
    hub: StandInHub, tiny_files: dict[str, bytes], tmp_path: Path
) -> None:
    hub.add("org/tiny", tiny_files)
    weights = tiny_files["model.safetensors"]
    hub.cut_once["model.safetensors"] = len(weights) // 2
    r = resolve(hub.url, tmp_path / "hub", "org/tiny")
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.splitlines()[-1])
    assert read_dir(path) == needed(tiny_files)
    cut, resumed = hub.gets("/model.safetensors")
    offset = int(resumed[2].removeprefix("bytes=").removesuffix("-") or 0)
    assert cut[2] == "" and 0 < offset <= len(weights) // 2, hub.log  # from the last chunk it wrote
    for unused in ("README.md", "pytorch_model.bin", "model.onnx"):
        assert not hub.gets(unused)
    assert "Fetching" in r.stderr  # huggingface_hub's progress bar
    # Run again with the hub reachable: nothing is fetched a second time.
    before = len(hub.gets(""))
    r = resolve(hub.url, tmp_path / "hub", "org/tiny")
    assert r.returncode == 0 and Path(r.stdout.splitlines()[-1]) == path, r.stderr
    assert len(hub.gets("")) == before


def test_a_failed_download_keeps_the_complete_files(
    hub: StandInHub, tiny_files: dict[str, bytes], tmp_path: Path
) -> None:
    hub.add("org/tiny", tiny_files)
    hub.fail_once["model.safetensors"] = 500
    r = resolve(hub.url, tmp_path / "hub", "org/tiny")
    assert r.returncode != 0 and "org/tiny: cannot fetch from the Hugging Face hub" in r.stderr, r.stderr
    r = resolve(hub.url, tmp_path / "hub", "org/tiny")
    assert r.returncode == 0, r.stderr
    assert len(hub.gets("/config.json")) == 1 and len(hub.gets("/tokenizer.json")) == 1
    assert len(hub.gets("/model.safetensors")) == 2


def test_unreachable_hub_falls_back_to_the_cache(tiny_files: dict[str, bytes], tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    snapshot = write_cache(cache, "org/tiny", tiny_files)
    with StandInHub() as gone:
        url = gone.url  # nothing listens there any more
    r = resolve(url, cache, "org/tiny")
    assert r.returncode == 0 and Path(r.stdout.splitlines()[-1]) == snapshot, r.stderr
    r = resolve(url, cache, "org/other")
    assert r.returncode != 0 and "org/other is not in the Hugging Face cache" in r.stderr, r.stderr
    assert "the hub cannot be reached" in r.stderr


def test_a_gated_repo_needs_hf_token(hub: StandInHub, tiny_files: dict[str, bytes], tmp_path: Path) -> None:
    hub.add("org/gated", tiny_files, token="hf_letmein")
    r = resolve(hub.url, tmp_path / "hub", "org/gated")
    assert r.returncode != 0 and "set HF_TOKEN" in r.stderr, r.stderr
    r = resolve(hub.url, tmp_path / "hub", "org/gated", env={"HF_TOKEN": "hf_letmein"})
    assert r.returncode == 0, r.stderr
    assert read_dir(Path(r.stdout.splitlines()[-1])) == needed(tiny_files)


def test_a_gguf_repo_gives_one_file(hub: StandInHub, tiny_dir: Path, tmp_path: Path) -> None:
    from test_gguf import write_tiny_gguf

    hf = save_tiny_hf_model("LlamaForCausalLM", tmp_path / "hf", tie=False, vocab=259)
    write_tiny_gguf(hf, tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    hub.add("org/tiny-GGUF", {"README.md": b"#", "tiny.F32.gguf": data, "tiny.Q8_0.gguf": data[:-7]})
    r = resolve(hub.url, tmp_path / "hub", "org/tiny-GGUF:f32")
    assert r.returncode == 0, r.stderr
    assert (Path(r.stdout.splitlines()[-1]) / "config.json").is_file()  # the GGUF's derived directory
    assert hub.gets("/tiny.F32.gguf") and not hub.gets("/tiny.Q8_0.gguf") and not hub.gets("README.md")
    r = resolve(hub.url, tmp_path / "hub2", "org/tiny-GGUF", gguf_file="tiny.F32.gguf")
    assert r.returncode == 0, r.stderr
    r = resolve(hub.url, tmp_path / "hub3", "org/tiny-GGUF")
    assert r.returncode != 0 and "is a GGUF repo" in r.stderr and "F32, Q8_0" in r.stderr, r.stderr


def test_serve_a_model_id_lists_it_in_v1_models(
    hub: StandInHub, tiny_files: dict[str, bytes], tmp_path: Path
) -> None:
    from test_server import ServerProcess, openai_client

    hub.add("org/tiny", tiny_files)
    srv = ServerProcess(
        "--model",
        "org/tiny",
        "--download-dir",
        str(tmp_path / "hub"),
        "--max-seq-len",
        "128",
        env={"HF_ENDPOINT": hub.url},
    )
    try:
        models = httpx.get(srv.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["org/tiny"]
        out = openai_client(srv).completions.create(model="org/tiny", prompt="hi", max_tokens=3)
        assert out.model == "org/tiny" and out.usage.completion_tokens >= 1
    finally:
        assert srv.stop() == 0
