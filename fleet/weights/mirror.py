"""The manifest of a ``hub`` model source, and its files on this machine (issue 22, part 1 and 2).

A mirror laid out like the Hugging Face Hub (``fleet.model.mirror``) is staged in two steps, so
that everything the mirror can refuse is refused before any host is touched, and the hosts get
exactly what a ``dir`` source gives them:

1. here, ``mirror_manifest``: the revision resolved to one commit and its files listed (sizes,
   LFS SHA-256, git blob ids); what this machine's copy (``model_source.cache_dir``, laid out as
   ``ORG/NAME/`` like a ``dir`` source) lacks or has wrong is downloaded and checked against that
   metadata, each file renamed into place only when it matches; files of another commit are
   removed. The manifest is the mirror's metadata (an LFS file's SHA-256 is the Hub's own; a small
   file's is hashed once its git blob id matched), cached beside the files
   (``fleet.weights.manifest``'s cache), so an unchanged copy is not hashed again;
2. then ``fleet.weights.stage`` (and the fan-out) sends those files to the hosts exactly as for a
   ``dir`` source, every host's copy verified against this manifest.

A copy that does not fit on this machine is refused with the numbers before anything is fetched.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from fleet.errors import FleetError
from fleet.inventory.spec import ModelSource
from fleet.model.mirror import (
    RemoteFile,
    check,
    clear_downloads,
    fetch_file,
    locked,
    partial_bytes,
    remote_snapshot,
)
from fleet.weights.manifest import FileEntry, Manifest, cached_hashes, remember_hashes
from fleet.weights.verify import fmt_bytes, space_refusal

#: ``note(text)``: a line for people while the mirror's files are fetched.
Note = Callable[[str], None]


def _have(want: RemoteFile, path: Path, cached: dict[str, list[object]]) -> str | None:
    """The SHA-256 of this machine's copy of ``want`` when it matches the mirror's metadata, else None.
    An LFS file whose (size, mtime) the cache already knows with the mirror's SHA-256 is not hashed
    again; a small file is checked against its git blob id every time (a new commit may change it)."""
    try:
        st = path.stat()
    except OSError:
        return None
    if not path.is_file() or st.st_size != want.size:
        return None
    if want.sha256 is not None and cached.get(want.path) == [st.st_size, st.st_mtime_ns, want.sha256]:
        return want.sha256
    why, sha = check(want, path)
    return sha if why is None else None


def _remove_others(top: Path, keep: set[str]) -> None:
    """Files of another commit (not in ``keep``) out of this machine's copy; dot names stay."""
    for dirpath, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            rel = Path(dirpath, name).relative_to(top).as_posix()
            if not name.startswith(".") and rel not in keep:
                Path(dirpath, name).unlink(missing_ok=True)


def mirror_manifest(
    source: ModelSource,
    model: str,
    hashed: list[str] | None = None,
    note: Note = lambda _t: None,
    *,
    fetch: bool = True,
) -> Manifest:
    """The manifest of ``model`` at the source's revision, with every file of it on this machine
    and checked (see the module docstring). ``hashed`` receives the paths downloaded this time.
    ``fetch=False`` (a dry run): the LFS files this machine lacks are not downloaded, their
    manifest entries are the mirror's metadata (the same manifest a fetch would give; the small
    files are still fetched: their SHA-256 is known only from their content).
    ``FleetError`` (``MirrorError``) says why not, naming the mirror, the model and the file."""
    snapshot = remote_snapshot(source, model)
    top = Path(source.model_dir(model))
    with locked(top):
        clear_downloads(top)
        cached = cached_hashes(top)
        digests: dict[str, str] = {}
        todo: list[RemoteFile] = []
        later: dict[str, str] = {}  #: LFS files left on the mirror (``fetch=False``)
        for want in snapshot.files:
            sha = _have(want, top / want.path, cached)
            if sha is not None:
                digests[want.path] = sha
            elif not fetch and want.sha256 is not None:
                later[want.path] = want.sha256
            else:
                todo.append(want)
        need = sum(f.size for f in todo)
        if todo:
            why = space_refusal(need, shutil.disk_usage(top).free, f"this machine ({top})")
            if why is not None:
                raise FleetError(f"model_source {source.endpoint}: fetching {model}: {why}")
            note(f"{model}: fetching {len(todo)} file(s), {fmt_bytes(need)}, from {source.endpoint} "
                 f"(commit {snapshot.commit[:12]})")  # fmt: skip
        for want in todo:
            have = partial_bytes(top, want)
            resumed = f", resuming at {fmt_bytes(have)} (kept from an interrupted run)" if have else ""
            note(f"{model}: fetching {want.path} ({fmt_bytes(want.size)}){resumed}")
            digests[want.path] = fetch_file(source, snapshot, want, top)
            if hashed is not None:
                hashed.append(want.path)
        _remove_others(top, set(digests) | set(later))
        clear_downloads(top, partials=not later)  # a dry run's partial files stay for the real one
        files: dict[str, list[object]] = {}
        for rel, sha in digests.items():
            st = (top / rel).stat()
            files[rel] = [st.st_size, st.st_mtime_ns, sha]
        remember_hashes(top, files)
    digests.update(later)
    entries = tuple(sorted(FileEntry(f.path, f.size, digests[f.path]) for f in snapshot.files))
    return Manifest(model, entries, snapshot.commit)
