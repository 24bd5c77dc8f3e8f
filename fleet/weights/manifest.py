"""The manifest of a model source: every file's relative path, size and SHA-256.

Computed on the control machine from the model's directory in the source (``model_source``,
``fleet.inventory.schema``), once: the result is cached in ``.fleet-manifest.json`` beside the
files (or, where the source is read-only, under ``$XDG_CACHE_HOME/fleet/manifests``), each
entry keyed by (relative path, size, mtime in ns), so an unchanged file is never hashed again
and a changed one always is. Files and directories whose name starts with ``.`` are not part of
the model (the cache itself, ``huggingface-cli download``'s ``.cache/``, editors' files).

The manifest's ``revision`` names the snapshot on the hosts: the first 40 hex digits of the
SHA-256 of its canonical text (a Hub commit id has 40 too), so the same files always land in
the same snapshot and a changed source lands in a new one, next to the old (``huggingface_hub``'s
cache layout: ``models--ORG--NAME/snapshots/<revision>/``, ``refs/main`` naming it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from fleet.errors import FleetError
from fleet.inventory.schema import source_model_dir
from fleet.localfs import atomic_write

CACHE_NAME = ".fleet-manifest.json"
CHUNK = 1 << 20
_VERSION = 1
#: A relative path in a manifest: it lands in paths on hosts (SFTP and the finishing script take
#: it as data, never through a shell), so no '..', no absolute path, no control characters.
_SAFE_PART = re.compile(r"[^/\x00-\x1f\x7f]+")


@dataclass(frozen=True, order=True)
class FileEntry:
    path: str  #: relative to the model directory, '/'-separated
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    model: str
    files: tuple[FileEntry, ...]  #: sorted by path
    #: a ``hub`` source: the commit the mirror resolved the revision to (not part of ``revision``:
    #: the same files from any source are the same snapshot)
    commit: str | None = field(default=None, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def text(self) -> str:
        """The canonical text (what ``revision`` hashes)."""
        return "".join(f"{f.sha256}  {f.size}  {f.path}\n" for f in self.files)

    @property
    def revision(self) -> str:
        return hashlib.sha256(self.text().encode()).hexdigest()[:40]

    def by_path(self) -> dict[str, FileEntry]:
        return {f.path: f for f in self.files}


def safe_relpath(rel: str) -> bool:
    """Whether ``rel`` may be a manifest path (see ``_SAFE_PART``)."""
    parts = rel.split("/")
    return bool(rel) and all(p not in ("", ".", "..") and _SAFE_PART.fullmatch(p) for p in parts)


def model_dir(root: str, model: str) -> Path:
    """Where a source directory holds ``model`` (``org/name``): ``ROOT/org/name``."""
    return Path(source_model_dir(root, model))


def _walk(top: Path) -> list[tuple[str, os.stat_result]]:
    """(relative path, stat) of every model file under ``top``, following file symlinks (an HF
    cache snapshot is made of links to blobs), skipping dot names."""
    out = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            full = Path(dirpath, name)
            rel = full.relative_to(top).as_posix()
            try:
                st = full.stat()
            except OSError as exc:
                raise FleetError(f"model source {top}: cannot read {rel}: {exc.strerror or exc}") from None
            if not full.is_file():
                continue
            if not safe_relpath(rel):
                raise FleetError(f"model source {top}: file name {rel!r} has control characters; rename it")
            out.append((rel, st))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _user_cache(top: Path) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fleet" / "manifests" / (hashlib.sha256(str(top).encode()).hexdigest()[:32] + ".json")


def _read_cache(paths: list[Path]) -> dict[str, list[object]]:
    for p in paths:
        with contextlib.suppress(OSError, ValueError):
            raw = json.loads(p.read_text())
            if isinstance(raw, dict) and raw.get("version") == _VERSION and isinstance(raw.get("files"), dict):
                return dict(raw["files"])
    return {}


def _write_cache(paths: list[Path], files: dict[str, list[object]]) -> None:
    """The cache in the first of ``paths`` that can be written (atomically, owner-only as
    before); none: fine."""
    text = json.dumps({"version": _VERSION, "files": files}, sort_keys=True)
    for p in paths:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(p, text, mode=0o600)
            return
        except OSError:
            continue
    # no cache anywhere: the manifest is still right, computed again next time


def cached_hashes(top: Path) -> dict[str, list[object]]:
    """The hash cache of a model directory: ``{relative path: [size, mtime_ns, sha256]}``."""
    return _read_cache([top / CACHE_NAME, _user_cache(top)])


def remember_hashes(top: Path, files: dict[str, list[object]]) -> None:
    """Write the hash cache of a model directory (``fleet.weights.mirror`` fills it as it checks)."""
    _write_cache([top / CACHE_NAME, _user_cache(top)], files)


def build_manifest(
    root: str, model: str, hashed: list[str] | None = None, *, directory: str = "", marker: str = "config.json"
) -> Manifest:
    """The manifest of ``model`` in the source directory ``root`` (cached, see the module
    docstring). ``hashed``, when given, receives the paths that were hashed this time.
    ``directory``: the files are there instead of ``ROOT/ORG/NAME`` (a LoRA adapter's own
    directory, ``lora_adapters``), with ``marker`` the file that must be in it."""
    top = Path(directory) if directory else model_dir(root, model)
    if not (top / marker).is_file():
        if directory:
            raise FleetError(f"adapter source {directory}: no {marker} there")
        raise FleetError(f"model source {root}: no {model}/{marker} there")
    cache_paths = [top / CACHE_NAME, _user_cache(top)]
    cached = _read_cache(cache_paths)
    files: dict[str, list[object]] = {}
    entries = []
    for rel, st in _walk(top):
        key = [st.st_size, st.st_mtime_ns]
        hit = cached.get(rel)
        if isinstance(hit, list) and len(hit) == 3 and hit[:2] == key and isinstance(hit[2], str):
            digest = hit[2]
        else:
            try:
                digest = _sha256(top / rel)
            except OSError as exc:
                raise FleetError(f"model source {top}: cannot read {rel}: {exc.strerror or exc}") from None
            if hashed is not None:
                hashed.append(rel)
        files[rel] = [*key, digest]
        entries.append(FileEntry(rel, st.st_size, digest))
    if files != cached:
        _write_cache(cache_paths, files)
    return Manifest(model, tuple(sorted(entries)))
