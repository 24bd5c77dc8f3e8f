"""A stand-in for a mirror laid out like the Hugging Face Hub, on 127.0.0.1, for the tests of
``model_source: {kind: hub}``. It answers only the requests ``huggingface_hub`` (2.4) makes for
what fleet calls, each as the Hub answers it:

* ``HfApi.model_info(repo, revision=...)`` (``hf_api.py``): ``GET /api/models/{repo}/revision/{rev}``
  → ``{"id", "sha", "siblings"}``;
* ``HfApi.list_repo_tree(repo, recursive=True, revision=...)`` (``hf_api.py``,
  ``_iter_repo_tree_pages``): ``GET /api/models/{repo}/tree/{rev}`` → a list of
  ``{"type": "file", "path", "size", "oid", "lfs": {"oid", "size", "pointerSize"}}`` (one page:
  no ``Link`` header);
* ``hf_hub_download`` (``file_download.py``: ``get_hf_file_metadata`` then ``http_get``):
  ``HEAD`` and ``GET /{repo}/resolve/{rev}/{path}`` with ``X-Repo-Commit``, ``ETag`` (the git
  blob id; for an LFS file ``X-Linked-Etag``, its SHA-256, and ``X-Linked-Size``) and
  ``Content-Length``;
* a ``GET`` with ``Range: bytes=N-`` (what ``http_get`` sends with ``resume_size=N``, through
  ``_adjust_range_header``): ``206 Partial Content`` with ``Content-Range: bytes N-LAST/SIZE``
  and the rest of the file, as the Hub (and any HTTP server, RFC 9110 section 14) answers; a
  range past the end is ``416`` with ``Content-Range: bytes */SIZE``.

Faults for the tests: ``cut[path] = N`` sends the headers of the whole file, then only its first
``N`` bytes, and closes the connection (a transfer broken mid-file); while ``down`` holds the
path, every other ``GET`` of it is answered ``503`` (the rest of an interrupted run).
``served[path]`` counts the bytes of file content sent, so a test tells a resumed download
(only the rest) from a whole one.

Errors carry the Hub's ``X-Error-Code`` (``RepoNotFound``, ``RevisionNotFound``,
``EntryNotFound``), which ``huggingface_hub.utils.hf_raise_for_status`` turns into its
exceptions; with ``token`` set, a request without ``Authorization: Bearer <token>`` gets 401
(``X-Error-Message: Invalid credentials in Authorization header`` for a wrong token, as the Hub).

A repository's metadata (sizes, SHA-256, blob ids, the commit) is taken when it is added, and its
files are served from disk as they are at each request: a file changed on disk afterwards is a
mirror whose copy no longer matches its own metadata.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: Files the Hub keeps in LFS (``.gitattributes`` of a model repository: ``*.safetensors filter=lfs``).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    root: Path
    commit: str
    files: dict[str, dict[str, object]]  #: path -> the tree entry


@dataclass
class HubStandIn:
    token: str | None = None
    repos: dict[str, Repo] = field(default_factory=dict)
    revisions: dict[tuple[str, str], str] = field(default_factory=dict)  #: (repo, branch) -> commit
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  #: (method, path, auth)
    server: ThreadingHTTPServer | None = None
    cut: dict[str, int] = field(default_factory=dict)  #: file path -> bytes sent before the connection closes
    down: set[str] = field(default_factory=set)  #: file paths answered 503 (after their cut)
    served: dict[str, int] = field(default_factory=dict)  #: file path -> bytes of content sent
    ranges: list[tuple[str, str]] = field(default_factory=list)  #: (file path, Range header) of each GET with one

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}"

    def add(self, repo: str, root: Path, branch: str = "main") -> str:
        """Serve the directory ``root`` as ``repo`` at ``branch``; the commit id."""
        files: dict[str, dict[str, object]] = {}
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            rel = path.relative_to(root).as_posix()
            data = path.read_bytes()
            entry: dict[str, object] = {"type": "file", "path": rel, "size": len(data), "oid": git_blob_id(data)}
            if rel.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n"
                entry["oid"] = git_blob_id(pointer.encode())
                entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": len(pointer)}
            files[rel] = entry
        commit = hashlib.sha1(json.dumps([repo, files], sort_keys=True).encode()).hexdigest()
        self.repos[repo] = Repo(root, commit, files)
        self.revisions[(repo, branch)] = commit
        return commit

    def __enter__(self) -> HubStandIn:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub._answer(self, head=True)

            def do_GET(self) -> None:
                hub._answer(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()

    # -- answers ------------------------------------------------------------------------------

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str | None, message: str | None = None) -> None:
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        if message:
            h.send_header("X-Error-Message", message)
        body = json.dumps({"error": message or code or "error"}).encode()
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _json(self, h: BaseHTTPRequestHandler, data: object) -> None:
        body = json.dumps(data).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _fault(self, h: BaseHTTPRequestHandler, rel: str) -> bool:
        """Answer 503 for a path that is ``down`` (and not being cut now): True when answered."""
        if rel in self.down and rel not in self.cut:
            self._error(h, 503, None, "Service Unavailable")
            return True
        return False

    def _commit(self, repo: str, rev: str) -> str | None:
        if rev == self.repos[repo].commit:
            return rev
        return self.revisions.get((repo, rev))

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        auth = h.headers.get("Authorization")
        path = urlsplit(h.path).path
        self.requests.append((h.command, path, auth))
        if self.token is not None and auth != f"Bearer {self.token}":
            # the Hub: no token, 401 (huggingface_hub reads it as RepositoryNotFoundError); a wrong one, 401 too
            self._error(h, 401, None, "Invalid credentials in Authorization header" if auth else None)
            return
        parts = [unquote(p) for p in path.split("/")[1:]]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
            if repo not in self.repos:
                self._error(h, 404, "RepoNotFound", "Repository not found")
                return
            commit = self._commit(repo, rev)
            if commit is None:
                self._error(h, 404, "RevisionNotFound", "Invalid rev id: " + rev)
                return
            files = self.repos[repo].files
            if kind == "revision":
                self._json(h, {"id": repo, "sha": commit, "siblings": [{"rfilename": p} for p in files]})
            else:
                self._json(h, list(files.values()))
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, rel = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            if repo not in self.repos:
                self._error(h, 404, "RepoNotFound", "Repository not found")
                return
            commit = self._commit(repo, rev)
            if commit is None:
                self._error(h, 404, "RevisionNotFound", "Invalid rev id: " + rev)
                return
            entry = self.repos[repo].files.get(rel)
            if entry is None:
                self._error(h, 404, "EntryNotFound", f"{rel} does not exist on {rev}")
                return
            data = (self.repos[repo].root / rel).read_bytes()
            if not head and self._fault(h, rel):
                return
            start, status = 0, 200
            asked = h.headers.get("Range")
            if not head and asked is not None:
                self.ranges.append((rel, asked))
                m = re.fullmatch(r"bytes=(\d+)-", asked.strip())
                if m is not None and int(m.group(1)) >= len(data):
                    h.send_response(416)
                    h.send_header("Content-Range", f"bytes */{len(data)}")
                    h.send_header("Content-Length", "0")
                    h.end_headers()
                    return
                if m is not None:
                    start, status = int(m.group(1)), 206
            h.send_response(status)
            h.send_header("X-Repo-Commit", commit)
            h.send_header("ETag", f'"{entry["oid"]}"')
            lfs = entry.get("lfs")
            if isinstance(lfs, dict):
                h.send_header("X-Linked-Etag", f'"{lfs["oid"]}"')
                h.send_header("X-Linked-Size", str(lfs["size"]))
            if status == 206:
                h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            h.send_header("Accept-Ranges", "bytes")
            h.send_header("Content-Length", str(len(data) - start))
            h.end_headers()
            if head:
                return
            body = data[start:]
            if rel in self.cut:  # a transfer broken mid-file: the first bytes, then the connection closes
                body = body[: self.cut.pop(rel)]
                self.down.add(rel)
                h.close_connection = True
            h.wfile.write(body)
            h.wfile.flush()
            self.served[rel] = self.served.get(rel, 0) + len(body)
            return
        self._error(h, 404, None, "not a path this stand-in answers")
