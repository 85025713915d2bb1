"""A Hugging Face hub on localhost, for tests without internet.

Serves model repos from local directories (one directory per revision) on the routes that
huggingface_hub 2.4 calls for `model_info` / `repo_info`, `list_repo_files` / `list_repo_tree`,
`hf_hub_download` and `snapshot_download`:

- `GET /api/models/{org}/{name}` and `GET /api/models/{org}/{name}/revision/{rev}`: the repo's
  info (`id`, `sha`, `siblings`, `private`, `gated`)
- `GET /api/models/{org}/{name}/tree/{rev}[/{path}]?recursive=...`: the file tree (LFS info for
  weight files; one page, no `Link` header)
- `HEAD` / `GET /{org}/{name}/resolve/{rev}/{path}`: a file, with `X-Repo-Commit`, `ETag` (the
  git blob sha1, or the sha256 for LFS files, as `X-Linked-Etag` too), `Content-Length`
  (`X-Linked-Size` for LFS files) and no redirect and no Xet headers, so the plain HTTP download
  path is taken

A revision is a branch or tag name, or the fake 40-hex commit sha `FakeHub.commit(repo, rev)`.
Errors carry the hub's `X-Error-Code` headers so that huggingface_hub raises its own errors:
`RepoNotFound` (404), `RevisionNotFound` (404), `EntryNotFound` (404), and for a gated repo
`GatedRepo` (401 without `Authorization: Bearer <token>`, 403 with another token) on file
downloads only (as the real hub: a gated repo's info and tree are public). A private repo answers
401 `RepoNotFound` on every route without the token. `log` lists every request as
"METHOD /path" (query left out); `downloads()` the files fetched with GET.

Use: point `HF_ENDPOINT` at `hub.url`, and `HF_HUB_CACHE` at an empty directory (`use_hub`, or the `hub`
fixture in tests/cluster/test_hub_download.py: huggingface_hub reads both at import, so it patches
`huggingface_hub.constants` too).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".gguf", ".model")


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class HubRepo:
    repo_id: str
    revisions: dict[str, Path]  # branch or tag name -> directory with the files
    gated: bool = False
    private: bool = False
    commits: dict[str, str] = field(default_factory=dict)  # fake sha -> revision name

    def files(self, rev: str) -> list[str]:
        root = self.revisions[rev]
        return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


class FakeHub:
    """A localhost hub: `with FakeHub() as hub: hub.add_repo("org/name", path); ... hub.url`."""

    def __init__(self, token: str = "hf_fake_test_token"):
        self.token = token
        self.repos: dict[str, HubRepo] = {}
        self.log: list[str] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ---- set-up --------------------------------------------------------------------------------

    @staticmethod
    def commit(repo_id: str, rev: str) -> str:
        """The fixed fake commit sha of a repo's revision."""
        return hashlib.sha1(f"{repo_id}@{rev}".encode()).hexdigest()

    def add_repo(self, repo_id: str, revisions: Path | dict[str, Path], gated: bool = False,
                 private: bool = False) -> HubRepo:
        if not isinstance(revisions, dict):
            revisions = {"main": Path(revisions)}
        repo = HubRepo(repo_id, {k: Path(v) for k, v in revisions.items()}, gated=gated, private=private)
        repo.commits = {self.commit(repo_id, rev): rev for rev in repo.revisions}
        self.repos[repo_id] = repo
        return repo

    # ---- life cycle ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self._server is not None, "the hub is not running"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- what was asked ------------------------------------------------------------------------

    def downloads(self, repo_id: str | None = None) -> list[str]:
        """Files fetched with GET .../resolve/..., as "org/name/path" (or "path" for one repo)."""
        out = []
        for entry in list(self.log):
            method, _, path = entry.partition(" ")
            parts = path.lstrip("/").split("/", 4)
            if method != "GET" or len(parts) < 5 or parts[2] != "resolve":
                continue
            rid, name = f"{parts[0]}/{parts[1]}", unquote(parts[4])
            if repo_id is None:
                out.append(f"{rid}/{name}")
            elif rid == repo_id:
                out.append(name)
        return out

    def clear_log(self) -> None:
        with self._lock:
            self.log.clear()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers when the hub stops

    def log_message(self, format, *args):  # quiet
        pass

    def do_HEAD(self):
        self._handle(head=True)

    def do_GET(self):
        self._handle(head=False)

    # ---- answers -------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False,
              content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, head: bool, extra: dict | None = None) -> None:
        headers = {"X-Error-Code": code, "X-Error-Message": message, **(extra or {})}
        self._send(status, json.dumps({"error": message}).encode(), headers, head)

    def _json(self, obj, head: bool) -> None:
        self._send(200, json.dumps(obj).encode(), head=head)

    def _authorized(self) -> bool:
        return self.headers.get("Authorization", "") == f"Bearer {self.hub.token}"

    def _handle(self, head: bool) -> None:
        url = urlsplit(self.path)
        with self.hub._lock:
            self.hub.log.append(f"{self.command} {url.path}")
        parts = url.path.lstrip("/").split("/")
        try:
            if parts[0] == "api" and len(parts) >= 4 and parts[1] == "models":
                self._api(parts[2:], url.query, head)
            elif len(parts) >= 5 and parts[2] == "resolve":
                self._resolve(f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote("/".join(parts[4:])), head)
            else:
                self._error(404, "NotFound", f"no route {url.path}", head)
        except BrokenPipeError:
            pass

    def _repo_and_rev(self, repo_id: str, rev: str, head: bool) -> tuple[HubRepo, str, str] | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self._authorized()):
            # the real hub answers 401 for a missing or private repo without credentials
            self._error(401 if not self._authorized() else 404, "RepoNotFound",
                        "Repository not found", head)
            return None
        name = repo.commits.get(rev, rev)
        if name not in repo.revisions:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            return None
        return repo, name, self.hub.commit(repo_id, name)

    def _api(self, parts: list[str], query: str, head: bool) -> None:
        repo_id = f"{parts[0]}/{parts[1]}"
        rest = parts[2:]
        if not rest:  # /api/models/{repo}
            rev, kind, path = "main", "revision", ""
        elif len(rest) >= 2 and rest[0] in ("revision", "tree"):
            kind, rev, path = rest[0], unquote(rest[1]), unquote("/".join(rest[2:]))
        else:
            return self._error(404, "NotFound", f"no route /api/models/{'/'.join(parts)}", head)
        found = self._repo_and_rev(repo_id, rev, head)
        if found is None:
            return
        repo, name, sha = found
        if kind == "revision":
            return self._json({
                "_id": sha[:24], "id": repo_id, "modelId": repo_id, "author": repo_id.split("/")[0],
                "sha": sha, "private": repo.private, "gated": "manual" if repo.gated else False,
                "disabled": False, "downloads": 0, "likes": 0, "tags": [], "library_name": "transformers",
                "lastModified": "2024-07-23T00:00:00.000Z",
                "siblings": [{"rfilename": f} for f in repo.files(name)],
            }, head)
        recursive = "recursive=true" in query.lower() or "recursive=1" in query
        self._json(self._tree(repo, name, path.strip("/"), recursive), head)

    def _tree(self, repo: HubRepo, rev: str, path: str, recursive: bool) -> list[dict]:
        root = repo.revisions[rev]
        base = root / path if path else root
        entries = base.rglob("*") if recursive else base.iterdir()
        out = []
        for p in sorted(entries):
            rel = p.relative_to(root).as_posix()
            if p.is_dir():
                out.append({"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "size": 0,
                            "path": rel})
                continue
            data = p.read_bytes()
            entry = {"type": "file", "oid": _git_blob_sha1(data), "size": len(data), "path": rel}
            if p.name.endswith(LFS_SUFFIXES):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            out.append(entry)
        return out

    def _resolve(self, repo_id: str, rev: str, filename: str, head: bool) -> None:
        found = self._repo_and_rev(repo_id, rev, head)
        if found is None:
            return
        repo, name, sha = found
        if repo.gated and not self._authorized():
            status = 403 if self.headers.get("Authorization") else 401
            return self._error(status, "GatedRepo",
                               f"Access to model {repo_id} is restricted. You must have access to it and be "
                               "authenticated to access it. Please log in.", head, {"X-Repo-Commit": sha})
        path = repo.revisions[name] / filename
        if not path.is_file() or ".." in Path(filename).parts:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on {rev!r}", head,
                               {"X-Repo-Commit": sha})
        data = path.read_bytes()
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if path.name.endswith(LFS_SUFFIXES):
            etag = hashlib.sha256(data).hexdigest()
            headers.update({"ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        else:
            headers["ETag"] = f'"{_git_blob_sha1(data)}"'
        self._send(200, data, headers, head, content_type="application/octet-stream")


def use_hub(monkeypatch, url: str, home: Path) -> None:
    """Point huggingface_hub (and rayspec's loader) at a hub at `url` with an empty cache under `home`
    and no token. huggingface_hub reads these at import: the environment is for what reads it at call
    time (rayspec's loader, the token lookup), the constants for the rest (the cache, and
    huggingface_hub's own side requests: never the internet)."""
    import huggingface_hub.constants as constants

    cache = home / "hub"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))  # not the developer's login
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
