"""``ModelCopy``: what a host holds of one model snapshot, in one remote command.

The host's ``python3`` (run as root through ``sudo -n``: the cache belongs to the service user)
walks ``<hub>/models--ORG--NAME/snapshots/<revision>/`` and prints one JSON line: each file's
size and SHA-256, what ``refs/main`` names, whether the service user exists, and the bytes free
(``statvfs``: ``f_bavail * f_frsize``, what an unprivileged writer may use) on the filesystem
the snapshot is (or will be) on, with the path asked. Leftovers of an interrupted copy (the
``.fleet-incoming`` directory) count as free: the next copy removes them first. The script keeps
to Python 3.6 (any host's ``python3``) and always exits 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pyinfra.api.facts import FactBase

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.weights.verify import HostFile

_END = "FLEET_MODEL_COPY_EOF"
INCOMING = ".fleet-incoming"

SCRIPT = r"""
import hashlib, json, os, pwd, sys
repo, revision, user = sys.argv[1], sys.argv[2], sys.argv[3]
snap = os.path.join(repo, "snapshots", revision)
out = {"files": {}, "refs_main": None, "user": True, "free": 0, "where": repo, "incoming": 0}
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
            size = os.stat(full).st_size
            h = hashlib.sha256()
            with open(full, "rb") as f:
                while True:
                    chunk = f.read(1 << 20)
                    if not chunk:
                        break
                    h.update(chunk)
            out["files"][rel] = [size, h.hexdigest()]
        except (IOError, OSError):
            out["files"][rel] = [-1, None]
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


@dataclass(frozen=True)
class HostCopy:
    """One host's copy of a snapshot (``ModelCopy``'s answer)."""

    files: dict[str, HostFile]
    refs_main: str | None
    user_exists: bool
    free: int  #: bytes free for the copy (leftovers of an interrupted copy included)
    where: str  #: the path whose filesystem ``free`` is of


def model_copy_command(repo: str, revision: str, user: str) -> str:
    argv = ["sudo", "-n", "--", "python3", "-", repo, revision, user]
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
        return HostCopy(files, raw.get("refs_main") or None, bool(raw["user"]), int(raw["free"]), str(raw["where"]))
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
        return parse_copy(next((line for line in reversed(output) if line.strip()), ""))
