"""The few Hugging Face Hub endpoints huggingface_hub 2.4.0 calls to read a model repo, served from a
directory on 127.0.0.1 by :class:`~file_server.FileServer` (so the same byte counts and switches), for
remote-checkpoint tests and bench/remote.py (issue 19). What the client calls (hf_api.py, file_download.py,
hf_file_system.py):

- ``GET /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}``: model info (``HfApi.model_info``,
  ``repo_info``; HfFileSystem checks the repo and revision with it): id, sha, siblings;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=``: one page of entries (``list_repo_tree``,
  ``HfFileSystem.ls``);
- ``POST /api/models/{repo}/paths-info/{rev}`` (form ``paths=…``): entries (``get_paths_info``, ``HfFileSystem.info``);
- ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``, with Range (``get_hf_file_metadata``, ``hf_hub_download``,
  ``get_safetensors_metadata``'s ``bytes=0-100000``, ``HfFileSystemFile._fetch_range``): the file with
  ``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag`` and ``X-Linked-Size``. ``redirect_to_cdn = True`` answers
  it with a 302 to ``/cdn/{sha}/{file}`` instead, as the Hub does for LFS files (on this server, or on
  ``cdn_url``'s: another HubServer of the same root, on 127.0.0.2 say, as the Hub's CDN is another host).

huggingface_hub also asks once per process for ``/api/agent-harnesses`` (a registry it does without): a 404
here, as every other path. Errors carry the Hub's ``X-Error-Code`` (RepoNotFound, RevisionNotFound, EntryNotFound), which
huggingface_hub turns into its own exceptions. The repo (``org/name``) has one revision, ``main``, whose
commit is :data:`COMMIT` (also accepted as the revision). A dataset or Space repo (``repo_type``) has the same
endpoints under ``/api/datasets/``, ``/datasets/{repo}/resolve/`` (``/api/spaces/``, ``/spaces/…``).

    with HubServer(tmp_path) as hub:                 # or the ``hub_server`` fixture, which points HF_ENDPOINT here
        HfApi(endpoint=hub.base_url).get_safetensors_metadata("org/name")
        hub.counts.bytes_sent[hub.resolve_path("model.safetensors")]
"""

from __future__ import annotations

import hashlib
import json
import re
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from tests.file_server import FileHandler, FileServer, etag_of

COMMIT = "c0ffee0123456789abcdef0123456789abcdef01"
REPO = "org/name"

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_API = r"/api/(?P<kind>models|datasets|spaces)"
_INFO = re.compile(rf"{_API}/{_REPO}(?:/revision/(?P<rev>[^/]+))?")
_TREE = re.compile(rf"{_API}/{_REPO}/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?")
_PATHS_INFO = re.compile(rf"{_API}/{_REPO}/paths-info/(?P<rev>[^/]+)")
_RESOLVE = re.compile(rf"/(?:(?P<kind>datasets|spaces)/)?{_REPO}/resolve/(?P<rev>[^/]+)/(?P<path>.+)")
#: a repo type → its URL paths' prefix (a model's none) and its API's collection, as huggingface_hub spells them
PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_KINDS = {None: "model", "models": "model", "datasets": "dataset", "spaces": "space"}
_CDN = re.compile(rf"/cdn/{COMMIT}/(?P<path>.+)")


class HubServer(FileServer):
    """Serves ``root`` as the repo ``repo`` at revision ``main`` (commit :data:`COMMIT`): a model repo, or with
    ``repo_type`` ``"dataset"``/``"space"`` one of those (its paths then under ``/datasets/``, ``/api/datasets/`` …)."""

    def __init__(self, root: str | Path, repo: str = REPO, repo_type: str = "model", host: str = "127.0.0.1") -> None:
        super().__init__(root, host=host)
        self.repo, self.repo_type = repo, repo_type
        self.redirect_to_cdn = False
        self.cdn_url: str | None = None  # the CDN's base URL (default: this server's)

    def resolve_path(self, name: str, revision: str = "main") -> str:
        """The URL path of a file's resolve endpoint (the key of its counts)."""
        return f"/{PREFIX[self.repo_type]}{self.repo}/resolve/{revision}/{name}"

    def resolve_url(self, name: str, revision: str = "main") -> str:
        return self.base_url + self.resolve_path(name, revision)

    def file_bytes(self, name: str) -> int:
        """Body bytes sent of the file ``name``, through its resolve endpoint (either revision) or the CDN."""
        paths = {self.resolve_path(name), self.resolve_path(name, COMMIT), f"/cdn/{COMMIT}/{name}"}
        with self.counts.lock:
            return sum(n for path, n in self.counts.bytes_sent.items() if path in paths)

    # -- what the repo holds ----------------------------------------------------------------------
    def entry(self, name: str) -> dict[str, Any] | None:
        """A tree/paths-info entry for ``name`` (relative to root): a file or a directory, or None."""
        target = (self.root / name).resolve()
        if not target.is_relative_to(self.root.resolve()) or not target.exists() or target == self.root.resolve():
            return None
        oid = hashlib.sha1(f"{name}:{etag_of(target)}".encode()).hexdigest()
        if target.is_dir():
            return {"type": "directory", "oid": oid, "path": name}
        return {"type": "file", "oid": oid, "size": target.stat().st_size, "path": name}

    def listing(self, folder: str, recursive: bool) -> list[dict[str, Any]] | None:
        base = (self.root / folder).resolve()
        if not base.is_relative_to(self.root.resolve()) or not base.is_dir():
            return None
        children = sorted(base.rglob("*") if recursive else base.iterdir())
        entries = [self.entry(p.relative_to(self.root.resolve()).as_posix()) for p in children]
        return [e for e in entries if e is not None]

    # -- the endpoints ----------------------------------------------------------------------------
    def route(self, handler: FileHandler, method: str, path: str, served: int) -> bool:
        if (m := _CDN.fullmatch(path)) is not None and method in ("GET", "HEAD"):
            return self._file(handler, method, path, m.group("path"), served, redirect=False)
        for pattern, methods, answer in ((_TREE, ("GET",), self._tree), (_PATHS_INFO, ("POST",), self._paths_info),
                                         (_INFO, ("GET",), self._info)):
            if (m := pattern.fullmatch(path)) is not None and method in methods:
                if (refusal := self._check(m.group("repo"), m.group("rev"), m.group("kind"))) is not None:
                    self._error(handler, *refusal)
                else:
                    answer(handler, m)
                return True
        if (m := _RESOLVE.fullmatch(path)) is not None and method in ("GET", "HEAD"):
            if (refusal := self._check(m.group("repo"), m.group("rev"), m.group("kind"))) is not None:
                self._error(handler, *refusal)
                return True
            return self._file(handler, method, path, m.group("path"), served, redirect=self.redirect_to_cdn)
        return False

    def _check(self, repo: str, rev: str | None, kind: str | None) -> tuple[int, str, str] | None:
        if repo != self.repo or _KINDS[kind] != self.repo_type:
            return HTTPStatus.NOT_FOUND, "RepoNotFound", f"Repository {repo} not found"
        if rev not in (None, "main", COMMIT):
            return HTTPStatus.NOT_FOUND, "RevisionNotFound", f"Invalid rev id: {rev}"
        return None

    def _error(self, handler: FileHandler, code: int, error_code: str, message: str) -> None:
        handler.send_simple(code, json.dumps({"error": message}).encode(),
                            {"X-Error-Code": error_code, "X-Error-Message": message, "X-Repo-Commit": COMMIT},
                            content_type="application/json")

    def _json(self, handler: FileHandler, value: Any) -> None:
        handler.send_simple(HTTPStatus.OK, json.dumps(value).encode(), {"X-Repo-Commit": COMMIT},
                            content_type="application/json")

    def _info(self, handler: FileHandler, m: re.Match[str]) -> None:
        files = [e["path"] for e in self.listing("", recursive=True) or [] if e["type"] == "file"]
        self._json(handler, {"_id": "0" * 24, "id": self.repo, "modelId": self.repo, "sha": COMMIT, "private": False,
                             "gated": False, "disabled": False, "tags": [], "siblings": [{"rfilename": f} for f in files]})

    def _tree(self, handler: FileHandler, m: re.Match[str]) -> None:
        query = parse_qs(handler.path.partition("?")[2])
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        entries = self.listing((m.group("path") or "").strip("/"), recursive)
        if entries is None:
            return self._error(handler, HTTPStatus.NOT_FOUND, "EntryNotFound", f"{m.group('path')} does not exist")
        return self._json(handler, entries)

    def _paths_info(self, handler: FileHandler, m: re.Match[str]) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        form = parse_qs(handler.rfile.read(length).decode())
        entries = [self.entry(p.strip("/")) for p in form.get("paths", [])]
        self._json(handler, [e for e in entries if e is not None])

    def _file(self, handler: FileHandler, method: str, path: str, name: str, served: int, redirect: bool) -> bool:
        self.apply_change(name, served)
        file = self.file_for(name)
        if file is None:
            self._error(handler, HTTPStatus.NOT_FOUND, "EntryNotFound", f"{name} does not exist on 'main'")
            return True
        etag = etag_of(file)
        hub = {"X-Repo-Commit": COMMIT, "X-Linked-Etag": etag, "X-Linked-Size": str(file.stat().st_size)}
        if redirect:
            cdn = self.cdn_url or self.base_url
            handler.send_simple(HTTPStatus.FOUND, b"", {**hub, "ETag": etag, "Location": f"{cdn}/cdn/{COMMIT}/{name}"})
        else:
            handler.send_file(method, path, file, hub)
        return True
