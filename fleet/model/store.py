"""The planning files of a model held by a store host (``model_source: {kind: store, host, path}``).

``fleet plan`` (and every command that plans: deploy, rollout) reads a model's ``config.json``,
``tokenizer_config.json`` and ``model.safetensors.index.json`` (``fleet.model.config.read_checkpoint``;
``fleet.model.mirror.PLANNING_FILES``). For a ``store`` source these are on the store host, so they
are read from there, over the store's own SSH settings and ``known_hosts``
(``fleet.facts.sshlink.connect``: nothing new to trust), by one remote command that prints the
small files and nothing else (the weights stay where they are), into a directory on this
machine that mirrors the store's (``ModelSource.planning_dir``:
``$XDG_CACHE_HOME/fleet/store/<host>-<sha256(path)[:12]>/ORG/NAME``). The plan is thus made from
the same ``config.json`` the hosts are given, as for a ``hub`` source (the mirror's), and a
store's changed file is read again next time. A file the store does not hold is removed here too
(an old ``model.safetensors.index.json`` must not outlive the store's).

Every refusal is a ``FleetError`` naming the store host, its path, the model and the way out:
the store unreachable, no such directory, the model (its ``config.json``) not there, a file that
cannot be read or is too large to be a planning file.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fleet.errors import FleetError
from fleet.escape import ssh_command
from fleet.facts.output import answer_line
from fleet.facts.sshlink import SshError, SshTarget, run_once
from fleet.localfs import atomic_write

#: What ``fleet plan`` reads beside each other (the same three a ``hub`` source fetches).
PLANNING_FILES = ("config.json", "tokenizer_config.json", "model.safetensors.index.json")
#: The largest planning file taken from a store (a big model's index is a few MB; a larger file
#: is not one of these).
MAX_PLANNING_BYTES = 64 << 20
#: Seconds the store may take to answer (connect apart): reading three small files.
READ_S = 60.0
_END = "FLEET_STORE_PLANNING_EOF"

#: Run on the store as the SSH login user (standard-library ``python3``, 3.6 on): one JSON line.
SCRIPT = r"""
import base64, json, os, sys
root, top, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
names = sys.argv[4:]
out = {"status": "ok", "why": "", "files": {}}
def done(status, why):
    out["status"], out["why"], out["files"] = status, why, {}
    print(json.dumps(out))
    sys.exit(0)
if not os.path.isdir(root):
    done("no-root", "no such directory")
if not os.access(root, os.R_OK | os.X_OK):
    done("no-root", "not readable by the login user (uid %d)" % os.getuid())
if not os.path.isfile(os.path.join(top, names[0])):
    done("no-model", "no %s there" % os.path.join(top, names[0]))
for name in names:
    path = os.path.join(top, name)
    if not os.path.isfile(path):
        out["files"][name] = None
        continue
    try:
        size = os.stat(path).st_size
        if size > limit:
            done("too-big", "%s is %d bytes, more than a planning file's %d" % (path, size, limit))
        with open(path, "rb") as f:
            out["files"][name] = base64.b64encode(f.read(limit + 1)).decode("ascii")
    except (IOError, OSError) as exc:
        done("unreadable", "cannot read %s: %s" % (path, exc.strerror or exc))
print(json.dumps(out))
"""


def planning_command(root: str, top: str) -> str:
    """The remote command: ``SCRIPT`` on the store's ``python3``, as the login user."""
    argv = ["python3", "-", root, top, str(MAX_PLANNING_BYTES), *PLANNING_FILES]
    return f"cd / && {ssh_command(argv)} <<'{_END}'\n{SCRIPT}\n{_END}\n"


def _where(store: str, root: str, model: str) -> str:
    return f"model_source: store {store}, path {root}: {model}"


def store_answer(
    text: str, where: str, files_type: type[dict[str, object]] | type[list[object]]
) -> tuple[str, str, Any]:
    """A store script's JSON line (this module's ``SCRIPT`` and ``fleet.weights.store.SCRIPT``
    both answer ``{"status", "why", "files"}``) as ``(status, why, files)``, ``files`` of
    ``files_type``; ``FleetError`` after ``where`` when it is not one."""
    try:
        raw = json.loads(text)
        status, why, files = str(raw["status"]), str(raw["why"]), raw["files"]
        if not isinstance(files, files_type):
            raise TypeError(f"files is not a {files_type.__name__}")
    except (ValueError, KeyError, TypeError) as exc:
        raise FleetError(f"{where}: unreadable answer from the store {text[-200:]!r} ({exc})") from None
    return status, why, files


def parse_planning(store: str, root: str, model: str, text: str) -> dict[str, bytes | None]:
    """The script's JSON line as ``{file name: its bytes, or None where the store has no such file}``;
    ``FleetError`` naming the store, the path, the model and the way out when it is not there."""
    where = _where(store, root, model)
    status, why, files = store_answer(text, where, dict)
    if status == "no-root":
        raise FleetError(
            f"{where}: the store's directory {root}: {why} on {store}: create it there and copy the models into it "
            "as ORG/NAME/, or point model_source.path at where they are (the SSH login user must read it)"
        )
    if status == "no-model":
        raise FleetError(
            f"{where}: the model is not on the store ({why}): put its files in {root}/{model} on {store} "
            f"(huggingface-cli download {model} --local-dir there), or fix model or model_source"
        )
    if status != "ok":
        raise FleetError(
            f"{where}: {why}: make the model's planning files readable by the SSH login user on {store}, "
            "or set model_config to a copy of its config.json on this machine"
        )
    out: dict[str, bytes | None] = {}
    for name in PLANNING_FILES:
        value = files.get(name)
        try:
            out[name] = None if value is None else base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError):
            raise FleetError(f"{where}: unreadable {name} in the store's answer") from None
        if (data := out[name]) is not None and len(data) > MAX_PLANNING_BYTES:
            raise FleetError(f"{where}: {name} is larger than a planning file ({len(data)} bytes)")
    if out["config.json"] is None:
        raise FleetError(f"{where}: the store's answer has no config.json")
    return out


def write_planning(dest: Path, files: Mapping[str, bytes | None]) -> None:
    """The store's planning files into ``dest``, each written atomically (``atomic_write``: a
    plan read at the same time sees the old file or the new one); one the store lacks is
    removed. Unchanged files are left as they are."""
    dest.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = dest / name
        if data is None:
            path.unlink(missing_ok=True)
            continue
        try:
            if path.read_bytes() == data:
                continue
        except OSError:
            pass
        atomic_write(path, data)


_read: set[tuple[SshTarget, str, str, Path]] = set()
_read_lock = threading.Lock()


def forget() -> None:
    """Read the stores again next time (what this process read is forgotten)."""
    with _read_lock:
        _read.clear()


def fetch_store_planning_files(target: SshTarget, root: str, model: str, dest: Path) -> Path:
    """``model``'s planning files read from the store host ``target`` (``root/ORG/NAME`` there) into
    ``dest`` on this machine; ``dest``. Read once per process (a deploy reloads its inventory: it
    plans from what it read first, as a hub source's commit is resolved once). ``FleetError``
    says why not (before any host is touched)."""
    key = (target, root, model, dest)
    with _read_lock:
        if key in _read and (dest / "config.json").is_file():
            return dest
    top = os.path.join(root, *model.split("/"))
    where = _where(target.name, root, model)
    try:
        rc, out, err = run_once(target, planning_command(root, top), READ_S, label="reading the planning files")
    except SshError as exc:
        raise FleetError(
            f"{where}: cannot read its config.json from the store ({exc.reason}): check the store host's SSH "
            "settings and known_hosts in the inventory, or set model_config to a copy of its config.json here"
        ) from None
    if rc != 0:
        raise FleetError(f"{where}: reading its config.json on the store exited {rc}: {err.strip()[-300:]}")
    files = parse_planning(target.name, root, model, answer_line(out.splitlines()))
    try:
        write_planning(dest, files)
    except OSError as exc:
        raise FleetError(
            f"{where}: cannot keep its planning files in {dest} on this machine ({exc.strerror or exc}): make "
            "that directory writable (it is under $XDG_CACHE_HOME, default ~/.cache)"
        ) from None
    with _read_lock:
        _read.add(key)
    return dest
