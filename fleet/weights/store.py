"""A store host as a model source (``model_source: {kind: store, host, path}``).

The store is another host of the same inventory, reached with its own SSH settings and
``known_hosts`` (``fleet.facts.sshlink.connect``: nothing new to trust). Two things happen there:

1. **The manifest**, computed on the store by ``SCRIPT`` (standard-library ``python3``, run as the
   SSH login user: the one who must be able to read the models) and read back as one JSON line:
   every file's relative path, size and SHA-256, walked the way ``fleet.weights.manifest`` walks a
   ``dir`` source (dot names skipped, file symlinks followed), so the same files give the same
   revision from either kind of source. What it hashed is cached on the store, per model, in
   ``$XDG_CACHE_HOME/fleet/store-manifests/`` (default ``~/.cache``), keyed per file by size,
   inode, mtime and ctime as the hosts' hash cache is (``fleet.weights.copyfact``): an unchanged
   file is not read again. A missing or unreadable ``path``, or a model not under it, is a
   ``FleetError`` naming the store, the path and the way out, before any host is changed.
2. **The bytes** go from the store to each host directly, through the peer program of
   ``fleet stage --fanout`` (``fleet.weights.peer``): a receiver on the host listening on its
   staging port for the store's address only, with a one-time token, and a sender on the store
   (run as its login user) reading ``path/ORG/NAME``. The store is the root of the fan-out tree
   where the control machine is for a ``dir`` source; no host gets a login on another.

The manifest is the store's own, so each host's verify (``fleet.weights.verify``) catches what
changes between the listing and the copy, and any damage on the way or on the host's disk; a file
that was already damaged on the store when the manifest was computed is not caught (its SHA-256 is
the damaged bytes'), as for a ``dir`` source.
"""

from __future__ import annotations

import re

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.output import answer_line
from fleet.facts.sshlink import SshError, SshTarget, run_once
from fleet.model.store import store_answer
from fleet.weights.copyfact import CACHED_DIGEST
from fleet.weights.manifest import FileEntry, Manifest, safe_relpath

_END = "FLEET_STORE_MANIFEST_EOF"
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: The longest the store may take to hash a model it has not hashed before (700 GB at ~100 MB/s).
LIST_S = 4 * 3600.0

SCRIPT = (
    r"""
import hashlib, json, os, stat, sys
"""
    + CACHED_DIGEST
    + r"""
root, top, marker = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"status": "ok", "why": "", "files": [], "hashed": 0, "reused": 0}
def done(status, why):
    out["status"], out["why"], out["files"] = status, why, []
    print(json.dumps(out))
    sys.exit(0)
if not os.path.isdir(root):
    done("no-root", "no such directory")
if not os.access(root, os.R_OK | os.X_OK):
    done("no-root", "not readable by the login user (uid %d)" % os.getuid())
if not os.path.isfile(os.path.join(top, marker)):
    done("no-model", "no %s there" % os.path.join(top, marker))
base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
cache_path = os.path.join(base, "fleet", "store-manifests",
                          hashlib.sha256(top.encode()).hexdigest()[:32] + ".json")
cached, fresh = {}, {}
try:
    st = os.stat(cache_path)
    if st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        with open(cache_path) as f:
            cached = json.load(f)
        if not isinstance(cached, dict):
            cached = {}
except (IOError, OSError, ValueError):
    cached = {}
for dirpath, dirnames, filenames in os.walk(top):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    for name in sorted(filenames):
        if name.startswith("."):
            continue
        full = os.path.join(dirpath, name)
        rel = os.path.relpath(full, top).replace(os.sep, "/")
        try:
            st = os.stat(full)
            if not stat.S_ISREG(st.st_mode):
                continue
            fresh[rel] = cached_digest(full, st, cached.get(rel), out)
        except (IOError, OSError) as exc:
            done("unreadable", "cannot read %s: %s" % (rel, exc.strerror or exc))
        out["files"].append([rel, st.st_size, fresh[rel][4]])
if fresh != cached:
    try:
        os.makedirs(os.path.dirname(cache_path), mode=0o700, exist_ok=True)
        tmp = "%s.%d.tmp" % (cache_path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(fresh, f)
        os.rename(tmp, cache_path)
    except (IOError, OSError):
        pass
print(json.dumps(out))
"""
)


def store_manifest_command(root: str, top: str, marker: str = "config.json") -> str:
    """The remote command: ``SCRIPT`` on the store's ``python3``, as the login user."""
    return f"cd / && {ssh_command(['python3', '-', root, top, marker])} <<'{_END}'\n{SCRIPT}\n{_END}\n"


def parse_store_manifest(store: str, root: str, model: str, text: str) -> Manifest:
    """The script's JSON line as a ``Manifest``; ``FleetError`` naming the store, the path and
    the way out when the store has no such directory or model, or its answer is not one."""
    where = f"model_source: store {store}, path {root}"
    status, why, rows = store_answer(text, where, list)
    if status == "no-root":
        raise FleetError(
            f"{where}: {why} on {store}: create it there, copy the models into it as ORG/NAME/, or point "
            "model_source.path at where they are (the SSH login user must be able to read it)"
        )
    if status == "no-model":
        raise FleetError(
            f"{where}: {model} is not there ({why}): put its files in {root}/{model} on {store} "
            f"(huggingface-cli download {model} --local-dir there), or fix model or model_source"
        )
    if status != "ok":
        raise FleetError(f"{where}: {model}: {why}: make the model's files readable by the SSH login user")
    entries = []
    for row in rows:
        try:
            rel, size, digest = str(row[0]), int(row[1]), str(row[2])
        except (ValueError, TypeError, IndexError):
            raise FleetError(f"{where}: unreadable file entry {row!r} from the store") from None
        if not safe_relpath(rel):
            raise FleetError(f"{where}: file name {rel!r} in {model} has control characters; rename it on {store}")
        if size < 0 or not _SHA256.fullmatch(digest):
            raise FleetError(f"{where}: bad size or SHA-256 for {rel} from the store ({size}, {digest!r})")
        entries.append(FileEntry(rel, size, digest))
    return Manifest(model, tuple(sorted(entries)))


def store_manifest(target: SshTarget, root: str, top: str, model: str, marker: str = "config.json") -> Manifest:
    """``model``'s manifest computed on the store host ``target`` (``top``: its directory there)."""
    try:
        rc, out, err = run_once(target, store_manifest_command(root, top, marker), LIST_S, label="the store's manifest")
    except SshError as exc:
        raise FleetError(f"model_source: store {target.name}: {exc.reason}") from None
    if rc != 0:
        raise FleetError(f"model_source: store {target.name}: the manifest script exited {rc}: {err.strip()[-300:]}")
    return parse_store_manifest(target.name, root, model, answer_line(out.splitlines()))
