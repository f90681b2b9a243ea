"""Helpers for the model-id tests (no tests here): a local stand-in for the Hugging Face hub, and a hub
cache written file by file.

`StandInHub` answers what huggingface_hub asks of HF_ENDPOINT (read from its file_download.py,
_snapshot_download.py and hf_api.py): GET /api/models/{id}[/revision/{rev}] (the commit and the file
list), GET /api/models/{id}/tree/{rev} (files with sizes, LFS sha256), HEAD and GET
/{id}/resolve/{rev}/{file} (X-Repo-Commit, ETag, Content-Length; GET honours `Range: bytes=N-`
with a 206). Gated repos want `Authorization: Bearer <token>`. Faults for the tests: the first GET of
a file cut off after some bytes (the connection closed mid-body), or answered with an error status.
Every request is logged."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def commit_of(name: str) -> str:
    """A 40-hex commit id made from a name (stable across runs)."""
    return hashlib.sha1(name.encode()).hexdigest()


def is_lfs(path: str) -> bool:
    return path.endswith((".safetensors", ".gguf", ".bin"))


def etag_of(path: str, data: bytes) -> str:
    """The hub's ETag: an LFS file's sha256, a small file's git blob sha1."""
    if is_lfs(path):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """revisions: name -> (commit, {path: bytes}); `token`: the repo is gated behind it."""

    revisions: dict[str, tuple[str, dict[str, bytes]]]
    token: str | None = None

    def at(self, rev: str) -> tuple[str, dict[str, bytes]] | None:
        if rev in self.revisions:
            return self.revisions[rev]
        return next((r for r in self.revisions.values() if r[0] == rev), None)


@dataclass
class StandInHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    cut_once: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before closing
    fail_once: dict[str, int] = field(default_factory=dict)  # file path -> HTTP status of the first GET
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range header)

    def add(self, repo: str, files: dict[str, bytes], rev: str = "main", token: str | None = None) -> str:
        commit = commit_of(f"{repo}@{rev}")
        self.repos.setdefault(repo, Repo({}, token)).revisions[rev] = (commit, files)
        return commit

    def gets(self, suffix: str) -> list[tuple[str, str, str]]:
        """The logged GETs of a file ending with `suffix`."""
        return [e for e in self.log if e[0] == "GET" and "/resolve/" in e[1] and e[1].endswith(suffix)]

    def __enter__(self) -> StandInHub:
        hub = self

        class Handler(_Handler):
            state = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class _Handler(BaseHTTPRequestHandler):
    state: StandInHub

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def finish(self) -> None:
        try:
            super().finish()
        except OSError:  # the connection was cut on purpose
            pass

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _serve(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.state.log.append((self.command, path, self.headers.get("Range", "")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            self._api(parts[2] + "/" + parts[3], parts[4:])
        elif len(parts) >= 5 and parts[2] == "resolve":
            self._file(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
        else:
            self._error(404, "RepoNotFound", "no such route")

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.state.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted")
            return None
        return repo

    def _api(self, repo_id: str, rest: list[str]) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        rev = rest[1] if len(rest) >= 2 else "main"
        found = repo.at(rev)
        if found is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        commit, files = found
        if rest[:1] == ["tree"]:
            listing = []
            for p, data in sorted(files.items()):
                entry = {"type": "file", "path": p, "size": len(data), "oid": etag_of(p + "#git", data)}
                if is_lfs(p):
                    entry["lfs"] = {"oid": etag_of(p, data), "size": len(data), "pointerSize": 134}
                listing.append(entry)
            return self._json(listing)
        self._json({"id": repo_id, "sha": commit, "siblings": [{"rfilename": p} for p in sorted(files)]})

    def _file(self, repo_id: str, rev: str, name: str, body: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        found = repo.at(rev)
        if found is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        commit, files = found
        if name not in files:
            return self._error(404, "EntryNotFound", f"{name} not found", commit)
        data = files[name]
        if body and name in self.state.fail_once:
            return self._error(self.state.fail_once.pop(name), "", "stand-in failure", commit)
        start = _range_start(self.headers.get("Range", ""))
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{etag_of(name, data)}"')
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        if not body:
            return
        cut = self.state.cut_once.pop(name, None) if not start else None
        self.wfile.write(data[start:] if cut is None else data[:cut])
        if cut is not None:  # the connection dies mid-body
            self.wfile.flush()
            self.connection.shutdown(2)

    def _json(self, obj: object) -> None:
        raw = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(raw)

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        raw = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(raw)


def _range_start(header: str) -> int:
    """N of `bytes=N-` (0 for none)."""
    if not header.startswith("bytes="):
        return 0
    return int(header.removeprefix("bytes=").split("-")[0] or 0)


def write_cache(cache: Path, repo: str, files: dict[Path | str, bytes], rev: str = "main") -> Path:
    """A Hugging Face hub cache entry as huggingface_hub lays it out: blobs/<etag>, snapshots/<commit>/
    with relative symlinks to them, refs/<rev> holding the commit. Returns the snapshot directory."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    commit = commit_of(f"{repo}@{rev}")
    snapshot = storage / "snapshots" / commit
    for name, data in files.items():
        blob = storage / "blobs" / etag_of(str(name), data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / rev).write_text(commit)
    return snapshot


def read_dir(path: Path) -> dict[str, bytes]:
    """Every file under `path` by its relative path."""
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
