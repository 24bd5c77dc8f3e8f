"""A private cgroup for each lab host's systemd-nspawn, when systemd is not PID 1 here.

``systemd-nspawn --keep-unit`` treats the cgroup it starts in as its own and creates
``supervisor`` and ``payload`` beside itself. Two hosts started from the same cgroup would share
one ``payload`` and their systemds would manage (and kill) each other's services, so each host's
nspawn is started inside ``<hierarchy>/fleet-lab/<machine>`` in every hierarchy systemd uses: the
unified (v2) one and the named ``systemd`` v1 one on hybrid machines, or the single v2 tree.
When systemd is PID 1 here, nspawn asks it for a scope instead and none of this is used.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
LAB_CGROUP = "fleet-lab"


def systemd_is_pid1() -> bool:
    """Whether this machine was booted with systemd (then nspawn can allocate its own scope)."""
    return Path("/run/systemd/system").is_dir()


def hierarchies(root: Path = CGROUP_ROOT) -> list[Path]:
    """The cgroup hierarchies systemd (and so nspawn) uses on this machine."""
    if (root / "cgroup.controllers").exists():
        return [root]
    return [h for h in (root / "unified", root / "systemd") if (h / "cgroup.procs").exists()]


def host_cgroups(machine: str, root: Path = CGROUP_ROOT) -> list[Path]:
    """The cgroup directories (one per hierarchy) that hold ``machine``'s nspawn and payload."""
    return [h / LAB_CGROUP / machine for h in hierarchies(root)]


def create(paths: list[Path]) -> None:
    """Create the cgroups (the parent too)."""
    for p in paths:
        p.mkdir(parents=True, exist_ok=True)


def pids_in(path: Path) -> list[int]:
    """Every pid in the cgroup and its descendants."""
    pids: list[int] = []
    if not path.is_dir():
        return pids
    for procs in path.rglob("cgroup.procs"):
        try:
            pids += [int(x) for x in procs.read_text().split()]
        except OSError:
            continue
    return pids


def kill_all(paths: list[Path], timeout: float = 5.0) -> None:
    """SIGKILL every process left in the cgroups and wait until they are gone (the fallback when
    a container would not stop, or outlived its nspawn)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [pid for p in paths for pid in pids_in(p)]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def rmdir_tree(path: Path) -> bool:
    """rmdir ``path`` and its sub-cgroups, deepest first; True once it is gone."""
    subdirs = sorted((d for d in path.rglob("*") if d.is_dir()), key=lambda d: len(d.parts), reverse=True)
    for d in [*subdirs, path]:
        with contextlib.suppress(OSError):
            d.rmdir()
    return not path.exists()


def remove_tree(path: Path, timeout: float = 5.0) -> bool:
    """Remove one cgroup and its sub-cgroups (deepest first); its parent stays. True once gone.

    A cgroup whose last process was just killed or moved can stay busy (EBUSY) for a moment, so retry.
    """
    deadline = time.monotonic() + timeout
    while path.is_dir() and not rmdir_tree(path):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def remove(paths: list[Path], timeout: float = 5.0) -> None:
    """Remove the cgroups (deepest first) and the shared parent once it is empty."""
    for p in paths:
        remove_tree(p, timeout)
        with contextlib.suppress(OSError):
            p.parent.rmdir()
