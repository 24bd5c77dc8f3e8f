"""``ModelCopy``: what a host holds of one model snapshot, in one remote command.

The host's ``python3`` (run as root through ``sudo -n``: the cache belongs to the service user)
walks ``<hub>/models--ORG--NAME/snapshots/<revision>/`` and prints one JSON line: each file's
size and SHA-256, what ``refs/main`` names, whether the service user exists, and the bytes free
(``statvfs``: ``f_bavail * f_frsize``, what an unprivileged writer may use) on the filesystem
the snapshot is (or will be) on, with the path asked. Leftovers of an interrupted copy (the
``.fleet-incoming`` directory) count as free: the next copy removes them first. The script keeps
to Python 3.6 (any host's ``python3``) and always exits 0.

Hashing every file on every deploy is correct and slow (700 GB at 2 GB/s is six minutes per
host), so the script keeps what it hashed in a root-only cache, ``HASH_CACHE_DIR``: per file its
size, inode, mtime and ctime (in nanoseconds, taken before reading it) and the SHA-256. A file
whose four values are unchanged is not read again; any write, rename, ``touch`` or ``chmod``
moves its ctime, which no unprivileged process can set back (``utime`` sets ctime to now: POSIX
``stat``, "st_ctime"), so the service user cannot make a changed file pass as cached. That is
rsync's quick check (size and mtime) made stricter with the inode and ctime. What it cannot see
is a disk that flips bits under an unchanged inode: removing the cache
(``sudo rm -rf /var/cache/fleet/model-hashes``) makes the next listing read every byte again.
A cache that is missing, unreadable, not root's or writable by others is ignored.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.output import answer_line
from fleet.weights.verify import HostFile

_END = "FLEET_MODEL_COPY_EOF"
INCOMING = ".fleet-incoming"
#: Root-only directory of the hosts' hash caches (one JSON file per snapshot).
HASH_CACHE_DIR = "/var/cache/fleet/model-hashes"

#: Part of the host scripts that keep a hash cache (this one, ``fleet.weights.store``'s): a file's
#: cache entry ``[size, inode, mtime_ns, ctime_ns, sha256]``, hashed again only when the first four
#: changed (``was``: its entry in the cache, if any); ``out["hashed"]``/``out["reused"]`` count bytes.
CACHED_DIGEST = r"""
def cached_digest(full, st, was, out):
    key = [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]
    if isinstance(was, list) and len(was) == 5 and was[:4] == key:
        out["reused"] += st.st_size
        return key + [was[4]]
    h = hashlib.sha256()
    with open(full, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            h.update(chunk)
    out["hashed"] += st.st_size
    return key + [h.hexdigest()]
"""

SCRIPT = (
    r"""
import hashlib, json, os, pwd, stat, sys
"""
    + CACHED_DIGEST
    + r"""
repo, revision, user = sys.argv[1], sys.argv[2], sys.argv[3]
cache_path = sys.argv[4] if len(sys.argv) > 4 else None
snap = os.path.join(repo, "snapshots", revision)
out = {"files": {}, "refs_main": None, "user": True, "free": 0, "where": repo, "incoming": 0,
       "hashed": 0, "reused": 0}
cached, fresh = {}, {}
if cache_path:
    try:
        st = os.stat(cache_path)
        if st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            with open(cache_path) as f:
                cached = json.load(f)
            if not isinstance(cached, dict):
                cached = {}
    except (IOError, OSError, ValueError):
        cached = {}
try:
    pwd.getpwnam(user)
except KeyError:
    out["user"] = False
try:
    with open(os.path.join(repo, "refs", "main")) as f:
        out["refs_main"] = f.read().strip()
except (IOError, OSError):
    pass
for top, dirs, files in os.walk(snap):
    dirs.sort()
    for name in sorted(files):
        full = os.path.join(top, name)
        rel = os.path.relpath(full, snap).replace(os.sep, "/")
        try:
            st = os.stat(full)
            fresh[rel] = cached_digest(full, st, cached.get(rel), out)
            out["files"][rel] = [st.st_size, fresh[rel][4]]
        except (IOError, OSError):
            out["files"][rel] = [-1, None]
if cache_path and fresh != cached:
    try:
        os.makedirs(os.path.dirname(cache_path), mode=0o700, exist_ok=True)
        tmp = "%s.%d.tmp" % (cache_path, os.getpid())
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(fresh, f)
        os.rename(tmp, cache_path)
    except (IOError, OSError):
        pass
for top, dirs, files in os.walk(os.path.join(repo, ".fleet-incoming")):
    for name in files:
        try:
            out["incoming"] += os.lstat(os.path.join(top, name)).st_size
        except OSError:
            pass
where = repo
while not os.path.isdir(where) and where != "/":
    where = os.path.dirname(where)
st = os.statvfs(where)
out["free"] = st.f_bavail * st.f_frsize + out["incoming"]
out["where"] = where
print(json.dumps(out))
"""
)


@dataclass(frozen=True)
class HostCopy:
    """One host's copy of a snapshot (``ModelCopy``'s answer)."""

    files: dict[str, HostFile]
    refs_main: str | None
    user_exists: bool
    free: int  #: bytes free for the copy (leftovers of an interrupted copy included)
    where: str  #: the path whose filesystem ``free`` is of
    hashed_bytes: int = 0  #: bytes read and hashed by this listing
    reused_bytes: int = 0  #: bytes whose SHA-256 came from the host's hash cache (unchanged files)


def hash_cache_path(repo: str, revision: str) -> str:
    """The host's hash cache for one snapshot: named by the repository's path (hashed, so any path
    makes a plain file name) and the snapshot's revision."""
    return f"{HASH_CACHE_DIR}/{hashlib.sha256(repo.encode()).hexdigest()[:16]}-{revision}.json"


def model_copy_command(repo: str, revision: str, user: str) -> str:
    argv = ["sudo", "-n", "--", "python3", "-", repo, revision, user, hash_cache_path(repo, revision)]
    return f"cd / && {ssh_command(argv)} <<'{_END}'\n{SCRIPT}\n{_END}\n"


def parse_copy(text: str) -> HostCopy:
    """The script's JSON line as a ``HostCopy``; ``FleetError`` when it is not one."""
    try:
        raw = json.loads(text)
        files = {
            str(rel): HostFile(int(v[0]), None if v[1] is None else str(v[1]))
            for rel, v in dict(raw["files"]).items()
            if int(v[0]) >= 0
        }
        return HostCopy(
            files,
            raw.get("refs_main") or None,
            bool(raw["user"]),
            int(raw["free"]),
            str(raw["where"]),
            int(raw.get("hashed", 0)),
            int(raw.get("reused", 0)),
        )
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise FleetError(f"model copy: unreadable answer {text[-200:]!r} ({exc})") from exc


class ModelCopy(FactBase[HostCopy]):
    """
    What the host holds of one model snapshot: every file's size and SHA-256, ``refs/main``,
    whether the service user exists, and the bytes free there.

    + repo: ``<HF_HOME>/hub/models--ORG--NAME``; revision: the snapshot; user: the service user
    """

    def command(self, repo: str, revision: str, user: str) -> str:
        return model_copy_command(repo, revision, user)

    def process(self, output: list[str]) -> HostCopy:
        return parse_copy(answer_line(output))
