"""A model source laid out like the Hugging Face Hub (``model_source: {kind: hub}``), read on this
machine only, through ``huggingface_hub``, the Hub's own client (the one vLLM uses; it speaks any
``HF_ENDPOINT``): no host ever talks to the mirror, so an air-gapped fleet stays air-gapped.

* ``remote_snapshot``: the revision resolved to a commit (``HfApi.model_info``: ``GET
  /api/models/{repo}/revision/{revision}``, its ``sha``), then that commit's files
  (``HfApi.list_repo_tree(recursive=True)``: ``GET /api/models/{repo}/tree/{commit}``): each
  file's size, git blob id and, for an LFS file, the SHA-256 of its content (the Hub's LFS
  metadata, ``lfs.oid``). Asked once per (mirror, revision, model) in a process, so a deploy
  plans and stages one commit even if the branch moves meanwhile;
* ``fetch_file``: one file downloaded with the library's own pieces of ``hf_hub_download``
  (``file_download.py``: ``get_hf_file_metadata``, ``HEAD /{repo}/resolve/{commit}/{path}``, for
  where to download from; then ``http_get``, ``GET`` with a ``Range: bytes=N-`` header when ``N``
  bytes are already here) into a partial file beside its place, checked against that metadata
  (size; SHA-256 for an LFS file; the git blob id, SHA-1 of ``blob <size>\\0`` and the content, for
  a small one), then renamed into place: a file that does not match is never where anything reads
  it. **An interrupted download is resumed by the next run**: the partial file is kept, named by
  the file's content id (the LFS SHA-256, else the git blob id: only the same content continues),
  and the next run asks only for the rest (``http_get``'s ``resume_size``; a mirror that ignores
  the ``Range`` and answers 200 is read from the start, as the library does). The whole file is
  still checked before the rename; a resumed file that does not match is removed and refused, so
  the run after that downloads it whole. ``hf_hub_download`` itself (2.4) keeps no partial file
  across runs (``_download_to_tmp_and_move`` writes a process-unique ``.incomplete`` and removes
  it on failure), hence its pieces rather than the whole;
* ``fetch_planning_files``: the files ``fleet plan`` reads (``fleet.model.config.read_checkpoint``:
  ``config.json``, ``tokenizer_config.json``, ``model.safetensors.index.json``), when this machine
  has no matching copy.

Every refusal names the mirror, the model and what to fix, and never the token: a token the mirror
refuses (401/403) names the ``token_ref`` that gave it; no token is ever sent that the inventory
did not name (``token=False``: not the machine's ``HF_TOKEN`` or saved login).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.errors import FleetError
from fleet.inventory.spec import ModelSource
from fleet.logs import handler
from fleet.secret_store import read_secret

if TYPE_CHECKING:
    from huggingface_hub.hf_api import RepoFile

# huggingface_hub is imported where it is used: half a second that `fleet plan` on a dir source,
# and every other command, need not pay.

#: What ``fleet plan`` reads beside each other (``fleet.model.config.read_checkpoint``).
PLANNING_FILES = ("config.json", "tokenizer_config.json", "model.safetensors.index.json")
#: Where downloads land before they are checked and renamed: inside the model's directory (one
#: filesystem, so the rename is atomic), a dot name that no manifest lists (``fleet.weights.manifest``).
DOWNLOADS = ".fleet-download"
#: Interrupted downloads kept for the next run, under ``DOWNLOADS``: ``partial/<content id>``.
PARTIAL = "partial"
LOCK = ".fleet-lock"
CHUNK = 1 << 20
#: Seconds one metadata request may take (``huggingface_hub``'s default is 10).
TIMEOUT_S = 30.0


class MirrorError(FleetError):
    """The mirror cannot give the model as the inventory asks (the message says why and what to fix)."""


@dataclass(frozen=True)
class RemoteFile:
    """One file of a commit as the mirror describes it."""

    path: str
    size: int
    blob_id: str  #: the git blob id (for an LFS file: of its pointer)
    sha256: str | None  #: an LFS file's content SHA-256 (the Hub's LFS metadata), else None


@dataclass(frozen=True)
class RemoteSnapshot:
    model: str
    commit: str
    files: tuple[RemoteFile, ...]  #: sorted by path; dot names (``.gitattributes``) left out

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def file(self, path: str) -> RemoteFile | None:
        return next((f for f in self.files if f.path == path), None)


def _safe(path: str) -> bool:
    parts = path.split("/")
    return all(p not in ("", ".", "..") and p.isprintable() for p in parts)


def _hidden(path: str) -> bool:
    return any(p.startswith(".") for p in path.split("/"))


def _token(source: ModelSource) -> str | bool:
    """The bearer token the inventory names, or False: never the machine's own ``HF_TOKEN``."""
    return read_secret(source.token_ref, "model_source.token_ref") if source.token_ref is not None else False


def _where(source: ModelSource, model: str) -> str:
    return f"model_source {source.endpoint}: {model} at revision {source.revision}"


def _hub_logs_to_file() -> None:
    """``huggingface_hub`` prints its warnings on stderr itself (a ``StreamHandler`` on its root
    logger, ``huggingface_hub/utils/logging.py``): into fleet's log file instead, redacted
    (``fleet.logs``), never in the middle of fleet's output or ``--json`` runs."""
    import huggingface_hub.utils.logging as hub_logging

    logger = hub_logging.get_logger("huggingface_hub")
    for h in list(logger.handlers):
        if type(h) is logging.StreamHandler:
            logger.removeHandler(h)
    if handler() not in logger.handlers:
        logger.addHandler(handler())
    logger.propagate = False


def _transport() -> tuple[type[BaseException], ...]:
    """What ``huggingface_hub`` raises when the mirror does not answer: its HTTP errors (an
    ``OSError``), transport failures (connection refused, timeouts), offline mode."""
    import httpx2

    return (httpx2.TransportError, OSError)


def _explain(exc: BaseException, source: ModelSource, model: str, what: str) -> MirrorError:
    """A ``huggingface_hub`` or transport error as what to fix (redacted later like every output)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = _where(source, model)
    status = exc.response.status_code if isinstance(exc, HfHubHTTPError) else None
    if isinstance(exc, RevisionNotFoundError):
        return MirrorError(
            f"{where}: the mirror has no revision {source.revision!r} of {model}: fix model_source.revision "
            "(a branch, tag or commit the mirror holds)"
        )
    if status in (401, 403) or isinstance(exc, GatedRepoError):
        if source.token_ref is not None:
            return MirrorError(
                f"{where}: the mirror refused the token from model_source.token_ref {source.token_ref} "
                f"(HTTP {status}) while {what}: put a token the mirror accepts for {model} there"
            )
        return MirrorError(
            f"{where}: the mirror wants a token (HTTP {status}) while {what}: set model_source.token_ref "
            f"to env:NAME or file:/path holding one (the Hub answers so without a token for a model it does "
            f"not hold, too: check model)"
        )
    if isinstance(exc, RepositoryNotFoundError) or (status == 404 and not isinstance(exc, RemoteEntryNotFoundError)):
        return MirrorError(
            f"{where}: the mirror has no model {model}: fix model (org/name as the mirror names it) or "
            "model_source.endpoint"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return MirrorError(f"{where}: the mirror lists a file it then does not serve while {what}: {exc}")
    if isinstance(exc, HfHubHTTPError):
        return MirrorError(f"{where}: the mirror answered HTTP {status} while {what}: {str(exc).splitlines()[0]}")
    reason = str(exc).strip() or type(exc).__name__
    return MirrorError(
        f"{where}: cannot reach the mirror while {what} ({type(exc).__name__}: {reason}): check "
        "model_source.endpoint and that this machine reaches it"
    )


_known: dict[tuple[str, str, str, str], RemoteSnapshot] = {}
_known_lock = threading.Lock()


def _not_a_hub(source: ModelSource, model: str, what: str, exc: BaseException) -> MirrorError:
    return MirrorError(
        f"{_where(source, model)}: the answer while {what} is not the Hub's ({type(exc).__name__}: "
        f"{str(exc)[:200]}): is model_source.endpoint a mirror laid out like the Hugging Face Hub?"
    )


def forget() -> None:
    """Ask the mirror again next time (what this process resolved is forgotten)."""
    with _known_lock:
        _known.clear()


def _repo_file(f: RepoFile) -> RemoteFile:
    return RemoteFile(f.path, int(f.size), str(f.blob_id), f.lfs.sha256 if f.lfs is not None else None)


def remote_snapshot(source: ModelSource, model: str, *, fresh: bool = False) -> RemoteSnapshot:
    """The commit the source's revision names now, and its files (see the module docstring).
    ``fresh``: ask the mirror again even if this process asked before."""
    assert source.endpoint is not None, "a hub source"
    key = (source.endpoint, source.revision, str(source.token_ref), model)
    with _known_lock:
        if not fresh and key in _known:
            return _known[key]
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    _hub_logs_to_file()

    api = HfApi(endpoint=source.endpoint, token=_token(source), library_name="fleet")
    try:
        info = api.model_info(model, revision=source.revision, timeout=TIMEOUT_S)
    except _transport() as exc:
        raise _explain(exc, source, model, "resolving the revision") from None
    except (ValueError, KeyError, TypeError) as exc:  # not JSON, or not the Hub's
        raise _not_a_hub(source, model, "resolving the revision", exc) from None
    commit = info.sha
    if not isinstance(commit, str) or len(commit) != 40 or any(c not in "0123456789abcdef" for c in commit):
        raise MirrorError(
            f"{_where(source, model)}: the mirror's answer names no commit (sha {commit!r}): is "
            "model_source.endpoint a Hugging Face Hub mirror?"
        )
    try:
        entries = list(api.list_repo_tree(model, recursive=True, revision=commit))
    except _transport() as exc:
        raise _explain(exc, source, model, "listing the files") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise _not_a_hub(source, model, "listing the files", exc) from None
    files = []
    for entry in entries:
        if not isinstance(entry, RepoFile) or _hidden(entry.path):
            continue
        if not _safe(entry.path):
            raise MirrorError(f"{_where(source, model)}: the mirror lists a file named {entry.path!r}: refused")
        files.append(_repo_file(entry))
    snapshot = RemoteSnapshot(model, commit, tuple(sorted(files, key=lambda f: f.path)))
    if snapshot.file("config.json") is None:
        raise MirrorError(
            f"{_where(source, model)}: commit {commit[:12]} holds no config.json: not a model vLLM can "
            "serve; fix model or model_source.revision"
        )
    with _known_lock:
        _known[key] = snapshot
    return snapshot


def _hash(path: Path, blob: bool) -> tuple[str, str | None]:
    """(SHA-256, git blob id or None) of a file, in one read. The git blob id is git's object id
    (``git hash-object``): SHA-1 of ``blob <size>\\0`` and the content."""
    sha = hashlib.sha256()
    git = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False) if blob else None
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
            if git is not None:
                git.update(chunk)
    return sha.hexdigest(), git.hexdigest() if git is not None else None


def check(want: RemoteFile, path: Path) -> tuple[str | None, str]:
    """(why the file at ``path`` is not the mirror's ``want``, or None; its SHA-256): its size, then
    the SHA-256 of an LFS file or the git blob id of a small one, against the mirror's metadata."""
    size = path.stat().st_size
    if size != want.size:
        return f"{size} bytes, the mirror's metadata says {want.size}", ""
    sha, blob = _hash(path, want.sha256 is None)
    if want.sha256 is not None and sha != want.sha256:
        return f"sha256 {sha}, the mirror's LFS metadata says {want.sha256}", sha
    if blob is not None and blob != want.blob_id:
        return f"git blob id {blob}, the mirror's metadata says {want.blob_id}", sha
    return None, sha


@contextlib.contextmanager
def locked(top: Path) -> Iterator[None]:
    """One fleet process at a time fills a model's directory here (``flock`` on a dot file in it)."""
    top.mkdir(parents=True, exist_ok=True)
    with open(top / LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def partial_path(top: Path, want: RemoteFile) -> Path:
    """Where an interrupted download of ``want`` is kept: named by its content id, so a partial file
    of other content (another commit's) is never continued."""
    return top / DOWNLOADS / PARTIAL / (want.sha256 or want.blob_id)


def partial_bytes(top: Path, want: RemoteFile) -> int:
    """Bytes of ``want`` an earlier run left (0: none; a partial longer than the file does not count)."""
    try:
        size = partial_path(top, want).stat().st_size
    except OSError:
        return 0
    return size if size <= want.size else 0


def fetch_file(source: ModelSource, snapshot: RemoteSnapshot, want: RemoteFile, top: Path) -> str:
    """Download ``want`` to ``top/<path>``: into its partial file first (``partial_path``; continued
    where an earlier run stopped), checked against the mirror's metadata (``check``), then renamed
    into place; its SHA-256. ``MirrorError`` when it does not match (nothing is left where a
    manifest would list it, and the partial file is removed). The caller holds ``locked(top)``."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils._headers import build_hf_headers  # (the package re-exports it lazily)
    from huggingface_hub.utils.tqdm import disable_progress_bars

    disable_progress_bars()  # fleet shows its own progress; the library's bars would land in --json runs' stderr
    path = partial_path(top, want)
    path.parent.mkdir(parents=True, exist_ok=True)
    have = partial_bytes(top, want)
    token = _token(source)
    url = hf_hub_url(snapshot.model, want.path, revision=snapshot.commit, endpoint=source.endpoint)
    try:
        meta = get_hf_file_metadata(url, token=token, timeout=TIMEOUT_S, library_name="fleet", endpoint=source.endpoint)
        with open(path, "r+b" if have else "wb") as f:
            f.truncate(have)
            f.seek(have)
            http_get(
                meta.location, f, resume_size=have, headers=build_hf_headers(token=token, library_name="fleet"),
                expected_size=want.size, displayed_filename=want.path,
            )  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
    except _transport() as exc:  # the bytes that came are kept for the next run
        raise _explain(exc, source, snapshot.model, f"downloading {want.path}") from None
    why, sha = check(want, path)
    if why is not None:
        path.unlink(missing_ok=True)
        resumed = f", resumed at byte {have}" if have else ""
        raise MirrorError(
            f"{_where(source, snapshot.model)}: {want.path} as downloaded (commit {snapshot.commit[:12]}{resumed}) "
            f"has {why}: the mirror's copy is damaged or was changed under the same commit; nothing was sent to any "
            "host. Repair the file on the mirror (or point model_source at a good one) and run again"
        )
    dest = top / want.path
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(path, dest)
    return sha


def clear_downloads(top: Path, *, partials: bool = False) -> None:
    """Remove what an interrupted download left in ``top/.fleet-download`` but the partial files
    the next run continues (``partials``: those too, once every file of a commit is here)."""
    scratch = top / DOWNLOADS
    if partials:
        shutil.rmtree(scratch, ignore_errors=True)
        return
    for entry in scratch.iterdir() if scratch.is_dir() else ():
        if entry.name == PARTIAL and entry.is_dir() and not entry.is_symlink():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def fetch_planning_files(source: ModelSource, model: str) -> Path:
    """The files ``fleet plan`` reads, from the mirror into ``source.model_dir(model)`` where this
    machine has no copy that matches the mirror's metadata (a copy of another commit is replaced);
    the directory holding them. ``MirrorError`` says why not (before any host is touched)."""
    snapshot = remote_snapshot(source, model)
    top = Path(source.model_dir(model))
    with locked(top):
        for name in PLANNING_FILES:
            want = snapshot.file(name)
            if want is None:
                continue
            have = top / name
            if have.is_file() and check(want, have)[0] is None:
                continue
            fetch_file(source, snapshot, want, top)
        clear_downloads(top)
    return top
