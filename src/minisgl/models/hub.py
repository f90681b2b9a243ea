"""Hugging Face model ids (`ORG/NAME`, `ORG/NAME:QUANT` for one file of a GGUF repo) resolved through
huggingface_hub into a local snapshot directory or .gguf file.

Online, only what minisgl reads is downloaded (`select_files`: config, generation config, tokenizer
files and chat template, the sentence-transformers pooling files, the safetensors shards the index
names, or one .gguf), into the Hugging Face cache (HF_HOME / HF_HUB_CACHE, or --download-dir), with
huggingface_hub's progress bars, its HF_TOKEN for gated repos, and its resumption of a transfer cut
off midway (a Range request from where it stopped); files already complete are not fetched again.
With HF_HUB_OFFLINE=1, or when the hub cannot be reached, the cached snapshot of the revision is
used as it is; a model missing from the cache is an error naming the id, the cache and the command
that fetches it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from minisgl.models.config import ModelConfigError

logger = logging.getLogger(__name__)

# ORG/NAME (the hub's own character set), optionally :QUANT naming one file of a GGUF repo.
_MODEL_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+))?$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SPLIT_GGUF = re.compile(r"-\d{5}-of-\d{5}$")
# Top-level files minisgl reads besides the weights (missing ones are skipped).
META_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    # sentence-transformers: how an embedding model pools (`minisgl.models.pooling`)
    "modules.json",
    "config_sentence_transformers.json",
    "sentence_bert_config.json",
)
SHARD_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class HubOptions:
    """How a model id is fetched: `revision` (branch, tag or commit; None: main), `download_dir`
    (a Hugging Face cache directory; None: HF_HUB_CACHE), `gguf_file` (the file of a GGUF repo)."""

    revision: str | None = None
    download_dir: str | None = None
    gguf_file: str | None = None


def parse_model_id(text: str) -> tuple[str, str | None] | None:
    """("ORG/NAME", "QUANT" or None) if `text` is a model id, else None (a path, a bare name)."""
    if text.startswith(("/", ".", "~")) or "\\" in text:
        return None
    m = _MODEL_ID.match(text)
    return None if m is None else (m["repo"], m["quant"])


def cache_dir(options: HubOptions) -> Path:
    """The Hugging Face cache the model is looked for and downloaded into."""
    from huggingface_hub import constants

    return Path(options.download_dir or os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE).expanduser()


def fetch_model(
    model_id: str, options: HubOptions, require_weights: bool = True, progress: bool = True
) -> Path:
    """The snapshot directory (or .gguf file) of `model_id`, downloading what is missing when the hub
    can be reached. Raises ModelConfigError saying why not."""
    parsed = parse_model_id(model_id)
    if parsed is None:
        raise ModelConfigError(f"{model_id!r} is not a Hugging Face model id (ORG/NAME or ORG/NAME:QUANT)")
    repo, quant = parsed
    if quant and options.gguf_file:
        raise ModelConfigError(f"{model_id}: name the GGUF file by :QUANT or by --gguf-file, not both")
    if _offline():
        return _from_cache(repo, quant, options, require_weights, "HF_HUB_OFFLINE is set")
    try:
        commit, files = _list_files(repo, options)
    except Exception as e:
        reason = _unreachable(e)
        if reason is None:
            raise _hub_error(repo, options, e) from None
        return _from_cache(repo, quant, options, require_weights, reason)
    return _download(repo, commit, files, quant, options, require_weights, progress)


# -- choosing the files ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """The files of a repo to fetch; `gguf`: the one GGUF file among them (None: a safetensors dir)."""

    files: list[str]
    gguf: str | None = None


def select_files(
    repo: str,
    files: list[str],
    quant: str | None,
    gguf_file: str | None,
    require_weights: bool,
    shard_names: list[str] | None = None,
) -> Selection:
    """What to fetch of a repo holding `files`: one .gguf (named by `quant` or `gguf_file`), or the
    config/tokenizer files and, if `require_weights`, the safetensors (`shard_names`: those the
    shard index names, when the repo has one)."""
    if gguf_file is not None:
        if gguf_file not in files:
            raise ModelConfigError(f"{repo}: no file {gguf_file!r} in the repo{_gguf_hint(files)}")
        return Selection([gguf_file], gguf_file)
    if quant is not None:
        return _select_quant(repo, files, quant)
    top = [f for f in files if "/" not in f]
    chosen = [f for f in META_FILES if f in top] + _pooling_files(files)
    weights = shard_names if shard_names is not None else [f for f in top if f.endswith(".safetensors")]
    if not weights and any(f.endswith(".gguf") for f in files):
        raise ModelConfigError(
            f"{repo} is a GGUF repo: name one file as {repo}:QUANT or with --gguf-file{_gguf_hint(files)}"
        )
    if "config.json" not in chosen:
        raise ModelConfigError(f"{repo}: the repo has no config.json (not a transformers model)")
    if require_weights:
        if not weights:
            raise ModelConfigError(
                f"{repo}: the repo has no *.safetensors weights (only safetensors is supported)"
            )
        chosen += ([SHARD_INDEX] if shard_names is not None else []) + weights
    return Selection(chosen)


def _select_quant(repo: str, files: list[str], quant: str) -> Selection:
    """The .gguf file whose name ends with `quant` (case-insensitive, after a '-', '.' or '_')."""
    ends = re.compile(rf"(^|[-._]){re.escape(quant)}$", re.IGNORECASE)
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    found = [f for f in ggufs if ends.search(PurePosixPath(f).stem)]
    split = [f for f in ggufs if _SPLIT_GGUF.search(PurePosixPath(f).stem) and quant.lower() in f.lower()]
    if not found and split:
        raise ModelConfigError(f"{repo}:{quant} is split into several files ({split[0]}, ...): not supported")
    if not found:
        raise ModelConfigError(f"{repo}: no GGUF file for {quant!r}{_gguf_hint(files)}")
    if len(found) > 1:
        top = [f for f in found if "/" not in f]
        if len(top) != 1:
            raise ModelConfigError(
                f"{repo}:{quant} matches {len(found)} files ({', '.join(found[:4])}): name one with --gguf-file"
            )
        found = top
    return Selection(found, found[0])


def _gguf_hint(files: list[str]) -> str:
    quants = sorted({_quant_name(f) for f in files if f.lower().endswith(".gguf")})
    return f" (its GGUF files: {', '.join(quants[:12])})" if quants else ""


def _quant_name(path: str) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'Q4_1' (the last '-'/'.' separated part of the stem)."""
    stem = _SPLIT_GGUF.sub("", PurePosixPath(path).stem)
    return re.split(r"[-.]", stem)[-1] or stem


def _pooling_files(files: list[str]) -> list[str]:
    """sentence-transformers' pooling configs (e.g. 1_Pooling/config.json)."""
    return [f for f in files if re.fullmatch(r"\d+_Pooling/config\.json", f)]


# -- the hub (online) -----------------------------------------------------------------------------


def _list_files(repo: str, options: HubOptions) -> tuple[str, list[str]]:
    """(commit, every file path) of the repo at the revision."""
    from huggingface_hub import HfApi

    info = HfApi().model_info(repo, revision=options.revision)
    if not info.sha:
        raise ModelConfigError(f"{repo}: the hub gave no commit for revision {options.revision or 'main'!r}")
    return info.sha, [s.rfilename for s in info.siblings or []]


def _download(
    repo: str,
    commit: str,
    files: list[str],
    quant: str | None,
    options: HubOptions,
    require_weights: bool,
    progress: bool,
) -> Path:
    from huggingface_hub import hf_hub_download, snapshot_download

    cache = cache_dir(options)
    shards = None
    if quant is None and options.gguf_file is None and require_weights and SHARD_INDEX in files:
        index = hf_hub_download(repo, SHARD_INDEX, revision=commit, cache_dir=cache)
        shards = _shard_names(Path(index))
    selection = select_files(repo, files, quant, options.gguf_file, require_weights, shards)
    logger.info("%s: fetching %d file(s) into %s", repo, len(selection.files), cache)
    try:
        folder = snapshot_download(
            repo,
            revision=commit,
            cache_dir=cache,
            allow_patterns=selection.files,
            tqdm_class=None if progress else _silent_tqdm(),
        )
    except Exception as e:
        raise _hub_error(repo, options, e) from None
    _remember_revision(Path(folder).parent.parent, options.revision, commit)
    return Path(folder) / selection.gguf if selection.gguf else Path(folder)


def _remember_revision(storage: Path, revision: str | None, commit: str) -> None:
    """refs/<revision> -> commit, as huggingface_hub writes it for a named revision, so that the
    cache answers for it offline (snapshot_download given the commit writes no ref)."""
    name = revision or "main"
    if _COMMIT.match(name):
        return
    ref = storage / "refs" / name
    if not ref.is_file() or ref.read_text().strip() != commit:
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)


def _shard_names(index: Path) -> list[str]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ModelConfigError(f"{index}: cannot read the shard index: {e}") from None


def _silent_tqdm() -> Any:
    """A tqdm class that shows nothing (progress=False)."""
    from tqdm.auto import tqdm

    class Silent(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


# -- the cache (offline) --------------------------------------------------------------------------


def _from_cache(
    repo: str, quant: str | None, options: HubOptions, require_weights: bool, reason: str
) -> Path:
    """The cached snapshot of the revision, used as it is (the hub is not asked)."""
    cache = cache_dir(options)
    folder = snapshot_folder(cache, repo, options.revision)
    if folder is None:
        raise ModelConfigError(
            f"{repo}{'@' + options.revision if options.revision else ''} is not in the Hugging Face cache "
            f"({cache}) and {reason}; fetch it with `{fetch_command(repo, options, quant)}` "
            "(or run with the hub reachable: minisgl downloads what it needs)"
        )
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    shards = _shard_names(folder / SHARD_INDEX) if (folder / SHARD_INDEX).is_file() else None
    try:
        selection = select_files(repo, files, quant, options.gguf_file, require_weights, shards)
    except ModelConfigError as e:
        raise ModelConfigError(f"{e} (in the cached snapshot {folder}; {reason})") from None
    missing = [f for f in selection.files if not (folder / f).is_file()]
    if missing:
        raise ModelConfigError(
            f"{repo}: the cached snapshot {folder} lacks {', '.join(missing[:3])} and {reason}; "
            f"fetch it with `{fetch_command(repo, options, quant)}`"
        )
    logger.info("%s: using the cached snapshot %s (%s)", repo, folder, reason)
    return folder / selection.gguf if selection.gguf else folder


def snapshot_folder(cache: Path, repo: str, revision: str | None) -> Path | None:
    """The cache's snapshot directory of `repo` at `revision` (a commit, or a branch/tag through
    refs/), if it is there (the cache layout huggingface_hub documents: models--ORG--NAME/...)."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache / repo_folder_name(repo_id=repo, repo_type="model")
    name = revision or "main"
    commit = name if _COMMIT.match(name) else None
    ref = storage / "refs" / name
    if commit is None and ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    folder = storage / "snapshots" / commit if commit else None
    return folder if folder is not None and folder.is_dir() else None


def fetch_command(repo: str, options: HubOptions, quant: str | None = None) -> str:
    """The `hf download` command that puts the model in the cache minisgl looks in."""
    cmd = ["hf", "download", repo]
    if options.gguf_file:
        cmd.append(options.gguf_file)
    elif quant:
        cmd += ["--include", f"'*{quant}*.gguf'"]
    if options.revision:
        cmd += ["--revision", options.revision]
    if options.download_dir:
        cmd += ["--cache-dir", options.download_dir]
    return " ".join(cmd)


# -- errors ---------------------------------------------------------------------------------------


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _network_errors() -> tuple[type[BaseException], ...]:
    """The exception types of a hub that cannot be reached: huggingface_hub's offline mode and its
    HTTP client's transport errors (httpx2 / httpx from huggingface_hub 1.0, requests before)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module, names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        errors += [getattr(mod, n) for n in names if isinstance(getattr(mod, n, None), type)]
    return tuple(errors)


def _unreachable(e: BaseException) -> str | None:
    """Why the hub cannot be reached (then the cache answers), or None for any other failure."""
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(e, _network_errors()):
        return f"the hub cannot be reached ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, HfHubHTTPError) and isinstance(status, int) and status >= 500:
        return f"the hub answered {status}"
    return None


def _hub_error(repo: str, options: HubOptions, e: BaseException) -> ModelConfigError:
    """A hub failure as the user should read it (the hub's message's first line, and what to do)."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if isinstance(e, ModelConfigError):
        return e
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, GatedRepoError) or getattr(getattr(e, "response", None), "status_code", None) in (
        401,
        403,
    ):
        hint = "; the repo is gated or private: set HF_TOKEN to a token with access to it"
    elif isinstance(e, RevisionNotFoundError):
        hint = f"; no revision {options.revision!r}"
    elif isinstance(e, RepositoryNotFoundError):
        hint = "; no such repo (or a private one: set HF_TOKEN)"
    else:
        hint = ""
    return ModelConfigError(
        f"{repo}: cannot fetch from the Hugging Face hub: {type(e).__name__}: {first}{hint}"
    )
